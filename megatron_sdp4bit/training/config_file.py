"""``--config FILE.yaml``: a file of flags, read with where each one is written.

Keys are flag names with dashes or underscores (``num_layers: 12``), values what
the flag takes (a list for ``data_path``, true/false for a switch). ``read_config``
turns the file into command-line words and remembers each flag's line, so that a
mistake in the file is said with its file and line: YAML that does not parse, a
key that is no flag (with the nearest flag's name), a key given twice, a value the
flag refuses, values that contradict each other. Mistakes raise ``ValueError``
(``arguments.py`` reports them as its ``ArgumentError``).
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Sequence


@dataclass
class ConfigFile:
    """A config file as command-line words, and the line each flag is on."""

    path: str
    argv: List[str] = field(default_factory=list)
    lines: Dict[str, int] = field(default_factory=dict)
    """flag (``--num-layers``) -> its line in the file (from 1)."""

    def where(self, message: str, command_line: Sequence[str] = ()) -> str:
        """``message`` with the file and line of every flag it names that the file
        sets and the command line does not override."""
        given = {word.split("=", 1)[0] for word in command_line if word.startswith("--")}
        named = [flag for flag in re.findall(r"--[A-Za-z0-9][\w-]*", message)
                 if flag in self.lines and flag not in given]
        named = list(dict.fromkeys(named))
        if not named:
            return message
        places = ", ".join(f"{flag} on line {self.lines[flag]}" for flag in named)
        return f"{message} (--config {self.path}: {places})"


def _known_flags(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def nearest_flag(flag: str, parser: argparse.ArgumentParser) -> str:
    """``"; did you mean --lr?"`` for a flag close to a known one, else ``""``."""
    close = difflib.get_close_matches(flag, [f for f in _known_flags(parser) if f.startswith("--")], n=1)
    return f"; did you mean {close[0]}?" if close else ""


def _parse_yaml(path: str):
    """(data, {key: line}) of a YAML mapping; ValueError naming the file and line."""
    import yaml

    if os.path.isdir(path):
        raise ValueError(f"--config {path} is a folder: pass a YAML file (e.g. configs/gpt_125m.yaml)")
    if not os.path.isfile(path):
        raise ValueError(f"--config {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except UnicodeDecodeError as error:
        raise ValueError(f"--config {path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"--config {path}{where}: not valid YAML ({problem})") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict) or not isinstance(node, yaml.MappingNode):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values (num_layers: 12), "
                         f"got a {type(data).__name__}")
    lines: Dict[str, int] = {}
    for key_node, _ in node.value:
        key = key_node.value
        if key in lines:
            raise ValueError(f"--config {path}, line {key_node.start_mark.line + 1}: {key} is given twice "
                             f"(first on line {lines[key]}); keep one")
        lines[key] = key_node.start_mark.line + 1
    return data, lines


def read_config(path: str, parser: argparse.ArgumentParser) -> ConfigFile:
    """The flags of the YAML file ``path`` as command-line words for ``parser``."""
    data, key_lines = _parse_yaml(path)
    known = _known_flags(parser)
    config = ConfigFile(path)
    for key, value in data.items():
        line = key_lines.get(str(key), 0)
        flag = "--" + str(key).replace("_", "-")
        action = known.get(flag)
        if action is None or flag == "--config":
            raise ValueError(f"--config {path}, line {line}: unknown key {key!r} (no flag {flag})"
                             + nearest_flag(flag, parser))
        config.lines[flag] = line
        if action.nargs == 0:  # a switch, or --flag/--no-flag
            if value is True:
                config.argv.append(flag)
            elif value is False and isinstance(action, argparse.BooleanOptionalAction):
                config.argv.append("--no-" + flag[2:])
            elif value not in (False, None):
                raise ValueError(f"--config {path}, line {line}: {key} takes true or false, got {value!r}")
        elif isinstance(value, list):
            config.argv += [flag] + [str(v) for v in value]
        elif isinstance(value, dict):
            raise ValueError(f"--config {path}, line {line}: {key} takes a value, not a mapping")
        elif value is not None:
            config.argv += [flag, str(value)]
    return config
