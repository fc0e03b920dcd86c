"""The figure of docs/results.md's gradient-outlier section, from the JSON files that
``gradient_outliers --json`` wrote:

    python -m megatron_sdp4bit.diagnostics.gradient_outliers_figure --out PNG \\
        NAME=FILE.json [NAME=FILE.json ...]

One column per setting (NAME): top, the 99th percentile of the groups' crest factor
per parameter kind over the sampled iterations, without the rotation (solid) and
with it (dashed), the threshold as a grey line; bottom, the 4-bit relative error of
all groups with TLq and with TLq-HS.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from megatron_sdp4bit.diagnostics.gradient_outliers import KINDS
from megatron_sdp4bit.training.figures import axis_labels, pyplot, save_figure


def series(samples: list, kind: str, field: str, stat: Optional[str] = None) -> tuple:
    """(iterations, values) of one kind's ``field`` (``stat`` of it when a summary)."""
    points = []
    for sample in samples:
        row = sample["kinds"].get(kind)
        if row is None:
            continue
        value = row[field] if stat is None else row[field].get(stat)
        if value is not None:
            points.append((sample["iteration"], value))
    return tuple(zip(*points)) if points else ((), ())


def draw(settings: dict, path: str) -> Optional[str]:
    plt = pyplot()
    if plt is None or not settings:
        return None
    fig, axes = plt.subplots(2, len(settings), figsize=(4.5 * len(settings), 7), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for column, (name, result) in enumerate(settings.items()):
        top, bottom = axes[0][column], axes[1][column]
        samples = result["samples"]
        for index, kind in enumerate(KINDS):
            color = colors[index % len(colors)]
            x, y = series(samples, kind, "crest", "p99")
            if x:
                top.plot(x, y, "o-", color=color, markersize=3, label=kind)
                x, y = series(samples, kind, "crest_rotated", "p99")
                top.plot(x, y, "--", color=color, linewidth=1)
        top.axhline(result["crest_threshold"], color="grey", linewidth=0.8)
        axis_labels(top, "iteration", "crest factor, p99 of groups", name)
        for field, label in (("error_tlq", "TLq (no rotation)"), ("error_tlq_hs", "TLq-HS")):
            x, y = series(samples, "all", field)
            bottom.plot(x, y, "o-", markersize=3, label=label)
        axis_labels(bottom, "iteration", "4-bit relative error, all groups")
    return save_figure(fig, [ax for row in axes for ax in row], path, dpi=100)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("settings", nargs="+", help="NAME=FILE.json")
    args = parser.parse_args(argv)
    settings = {}
    for item in args.settings:
        name, _, path = item.partition("=")
        if not path:
            parser.error(f"{item}: write NAME=FILE.json")
        with open(path, encoding="utf-8") as f:
            settings[name] = json.load(f)
    written = draw(settings, args.out)
    print(written or "no figure: matplotlib is missing (pip install -e .[plots])")
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
