#!/usr/bin/env python
"""Record the fingerprints of megatron's functions that the package wraps, replaces or copies.

Writes ``tests/megatron/megatron_fingerprints.json`` (``adapters/fingerprints.py``): for
each release given, the fingerprint of every seam its adapter lists (``Adapter.seams``),
keeping the other releases' entries. Review the changed functions first: the test of
that table fails exactly so that someone does (docs/megatron.md, "Fingerprints of
megatron's functions").

    python scripts/megatron_fingerprints.py --installed          # the venv's release
    pip download megatron-core==0.18.2 --no-deps --ignore-requires-python -d /tmp/w
    python scripts/megatron_fingerprints.py /tmp/w/megatron_core-0.18.2-*.whl

Wheels are read as zip files (nothing of them is imported), so any supported release
can be recorded from one venv.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os

from megatron_sdp4bit.megatron.adapters.fingerprints import (
    TABLE,
    installed_reader,
    release_fingerprints,
    wheel_reader,
    wheel_version,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheels", nargs="*", help="megatron-core wheels to read (pip download)")
    parser.add_argument("--installed", action="store_true", help="also the installed megatron-core")
    parser.add_argument("--table", default=TABLE, help=f"the table to update (default {TABLE})")
    args = parser.parse_args()
    if not args.wheels and not args.installed:
        parser.error("name wheels, or --installed")
    table = {}
    if os.path.exists(args.table):
        with open(args.table, encoding="utf-8") as file:
            table = json.load(file)
    releases = [(wheel_version(path), wheel_reader(path)) for path in args.wheels]
    if args.installed:
        releases.append((importlib.metadata.version("megatron-core"), installed_reader()))
    for version, read in releases:
        entry = release_fingerprints(version, read)
        changed = sorted(name for name in set(entry) | set(table.get(version, {}))
                         if entry.get(name, "-") != table.get(version, {}).get(name, "-"))
        table[version] = entry
        print(f"megatron-core {version}: {len(entry)} seams, {len(changed)} changed"
              + "".join(f"\n  {name}" for name in changed))
    with open(args.table, "w", encoding="utf-8") as file:
        json.dump(dict(sorted(table.items(), key=lambda item: _release_key(item[0]))), file, indent=1)
        file.write("\n")


def _release_key(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in version.split("."))


if __name__ == "__main__":
    main()
