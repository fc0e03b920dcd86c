"""Command-line flags for SDP4Bit, for Megatron-style argparse parsers.

``add_sdp4bit_args(parser)`` adds:
- ``--sdp4bit``: the paper's method (preset ``sdp4bit``);
- ``--sdp4bit-preset NAME``: any named preset (``sdp4bit``, ``zeropp``, ``qwd-only``,
  ``tlq-hs-only``, ``baseline``);
- ``--sdp4bit-<field>`` for every field of ``SDP4BitConfig`` (1:1, dashes for
  underscores), which override the preset;
- the reference fork's flag names as aliases (``--quantized-weights``,
  ``--wq-group-size``, ``--hadamard-transform``, ...), for people migrating.

``config_from_args(args)`` turns the parsed namespace into an ``SDP4BitConfig``, or
``None`` when no SDP4Bit flag asks for quantization. ``config_to_argv(config)``
writes the flags back, so a configuration round-trips through the command line.
This module does not import megatron, so launchers can use it before Megatron's
parser exists.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron_sdp4bit.config import ALLOWED, PRESETS, ConfigError, SDP4BitConfig

# String fields take their value as it is; every other field is an integer. What
# each may be is checked once, by SDP4BitConfig; ``config_from_args`` names the flag.
_STRING_FIELDS = ("weight_mode", "grad_mode", "rounding", "exact_reduce_scatter", "weight_gather",
                  "runner")


class SDP4BitFlagError(ValueError):
    """An ``--sdp4bit*`` flag (or a reference-fork alias) has a value SDP4Bit refuses.

    The message names the flag, its value and what it may be: one line for a user.
    """

# The reference fork's flags: alias name -> (dest, kwargs). Destinations are
# private names read by config_from_args; they never clash with Megatron's own.
_REFERENCE_ALIASES = {
    "--quantized-weights": ("sdp4bit_ref_quantized_weights", dict(action="store_true")),
    "--weight-quantization-bits": ("sdp4bit_ref_weight_bits", dict(type=int)),
    "--wq-group-size": ("sdp4bit_ref_weight_group_size", dict(type=int)),
    "--quantized-gradients": ("sdp4bit_ref_quantized_gradients", dict(action="store_true")),
    "--gradient-quantization-bits-intra": ("sdp4bit_ref_grad_bits_intra", dict(type=int)),
    "--gradient-quantization-bits-inter": ("sdp4bit_ref_grad_bits_inter", dict(type=int)),
    "--gq-group-size-intra": ("sdp4bit_ref_grad_group_size_intra", dict(type=int)),
    "--gq-group-size-inter": ("sdp4bit_ref_grad_group_size_inter", dict(type=int)),
    "--hadamard-transform": ("sdp4bit_ref_hadamard", dict(action="store_true")),
    "--gradient-alltoall-pipeline": ("sdp4bit_ref_pipeline_chunks", dict(type=int)),
    "--gradients-quantization-start-iteration": ("sdp4bit_ref_grad_start_iter", dict(type=int)),
}


def _flag(field_name: str) -> str:
    return "--sdp4bit-" + field_name.replace("_", "-")


def _integer(flag: str):
    """argparse type: an integer, with an error that says so (ranges: SDP4BitConfig)."""

    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects an integer, got {text!r}") from None

    parse.__name__ = "integer"
    return parse


def add_sdp4bit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the SDP4Bit flags to ``parser`` (a Megatron-LM parser or any other)."""
    group = parser.add_argument_group("sdp4bit", "4-bit communication (SDP4Bit)")
    group.add_argument(
        "--sdp4bit", action="store_true",
        help="Quantize communication as the SDP4Bit paper does: qWD 4-bit (group 2048) "
        "for the weight all-gather and TLq-HS 8/4-bit (group 128, Hadamard 32) for "
        "the gradient reduce-scatter.",
    )
    group.add_argument(
        "--sdp4bit-preset", choices=sorted(PRESETS), default=None,
        help="Start from a named configuration (overrides --sdp4bit's preset).",
    )
    for field in dataclasses.fields(SDP4BitConfig):
        group.add_argument(
            _flag(field.name), dest="sdp4bit_" + field.name, default=None,
            type=str if field.name in _STRING_FIELDS else _integer(_flag(field.name)),
            metavar="MODE" if field.name in _STRING_FIELDS else "N",
            help=f"{ALLOWED[field.name]} (overrides the preset; preset sdp4bit: {field.default!r})",
        )
    for alias, (dest, kwargs) in _REFERENCE_ALIASES.items():
        if "type" in kwargs:
            kwargs = dict(kwargs, type=_integer(alias), default=None, metavar="N")
        group.add_argument(alias, dest=dest, help=f"alias of the SDP4Bit reference fork's {alias}",
                           **kwargs)
    return parser


def _reference_overrides(args: argparse.Namespace) -> dict:
    """Fields set through the reference fork's flag names."""
    get = lambda name: getattr(args, "sdp4bit_ref_" + name, None)  # noqa: E731
    out = {}
    if get("quantized_weights"):
        out["weight_mode"] = "diff"
    if get("quantized_gradients"):
        out["grad_mode"] = "tlq-hs" if get("hadamard") else "tlq"
    for name in ("weight_bits", "weight_group_size", "grad_bits_intra", "grad_bits_inter",
                 "grad_group_size_intra", "grad_group_size_inter", "pipeline_chunks",
                 "grad_start_iter"):
        if get(name) is not None:
            out[name] = get(name)
    return out


def _alias_of(field_name: str) -> Optional[str]:
    """The reference fork's flag that sets ``field_name``, if there is one."""
    for alias, (dest, _) in _REFERENCE_ALIASES.items():
        if dest == "sdp4bit_ref_" + field_name:
            return alias
    return None


def config_from_args(args: argparse.Namespace) -> Optional[SDP4BitConfig]:
    """The configuration the flags ask for, or None when they ask for nothing.

    Raises ``SDP4BitFlagError`` naming the flag when the configuration is invalid.
    """
    explicit = {
        f.name: getattr(args, "sdp4bit_" + f.name)
        for f in dataclasses.fields(SDP4BitConfig)
        if getattr(args, "sdp4bit_" + f.name, None) is not None
    }
    reference = _reference_overrides(args)
    preset_name = getattr(args, "sdp4bit_preset", None)
    if preset_name is None and getattr(args, "sdp4bit", False):
        preset_name = "sdp4bit"
    if preset_name is None and not explicit and not reference:
        return None
    # Reference-fork flags describe the whole configuration from a baseline.
    base = PRESETS[preset_name or "baseline"]
    try:
        return base.replace(**{**reference, **explicit})
    except ConfigError as error:
        field = error.field
        if field in explicit:
            where = f"{_flag(field)} {explicit[field]}"
        elif field in reference and _alias_of(field):
            where = f"{_alias_of(field)} {reference[field]}"
        else:  # the preset's value, in conflict with another flag
            where = f"{_flag(field)} (preset {preset_name or 'baseline'}: {getattr(base, field)!r})"
        raise SDP4BitFlagError(f"{where}: {error}") from None


def config_to_argv(config: SDP4BitConfig) -> list[str]:
    """Flags that make ``config_from_args`` return ``config`` again."""
    argv = ["--sdp4bit-preset", "baseline"]
    for field in dataclasses.fields(SDP4BitConfig):
        value = getattr(config, field.name)
        if value is not None:
            argv += [_flag(field.name), str(value)]
    return argv
