"""``scripts/bench_slow_link.py``'s tables, its ``--json`` file and ``--replay`` of one.

``markdown_table``: per (link rate, preset) the median step, tokens/s, the speedup
over the first preset and the bytes (accounted and carried by the link);
``write_json`` every measured number (and the estimates); ``replay`` prints the
tables and the estimator comparison of such a file again, running nothing.
"""
from __future__ import annotations

import json
import statistics
from typing import Dict, Optional

from megatron_sdp4bit.benchmarks.slow_link.estimates import (Probed, estimate_rows,
                                                             print_estimate)
from megatron_sdp4bit.benchmarks.slow_link.presets import (GLOBAL_BATCH, NUM_LAYERS, OVERLAP,
                                                           PRESET_LABELS, SEQ_LENGTH, overlapped,
                                                           rate_label)
from megatron_sdp4bit.benchmarks.slow_link.runs import Cell, RunResult


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def markdown_table(args, cells: Dict[tuple, Cell]) -> str:
    reference = args.preset_list[0]
    head = ("| link (each direction) | collectives | median step s | run medians s | tokens/s "
            f"| speedup vs {reference} | MiB sent/rank/step (to other node) "
            "| MiB over link/step (measured) | load avg |")
    lines = [head, "|" + "---|" * 2 + "---:|" * 7]
    for rate in args.rate_list:
        ref_step = cells[(rate, reference)].median_step()
        for preset in args.preset_list:
            cell = cells[(rate, preset)]
            step = cell.median_step()
            runs = cell.runs
            sent = statistics.median(r.sent_per_step for r in runs)
            inter = statistics.median(r.sent_inter_per_step for r in runs)
            link = statistics.median(r.link_per_step for r in runs)
            lines.append(
                f"| {rate_label(rate)} | {PRESET_LABELS[preset]} | {step:.3f} "
                f"| {', '.join(f'{m:.2f}' for m in cell.run_medians())} "
                f"| {GLOBAL_BATCH * SEQ_LENGTH / step:,.0f} | {ref_step / step:.2f}x "
                f"| {mib(sent)} ({mib(inter)}) | {mib(link)} "
                f"| {statistics.median(r.load for r in runs):.1f} |")
    return "\n".join(lines)


def overlap_pairs(args) -> list:
    """The presets run both without and with ``-overlap``, when the grid has a no-limit
    rate to measure compute plus arithmetic (L) on."""
    if None not in args.rate_list:
        return []
    return [p for p in args.preset_list if not overlapped(p) and p + OVERLAP in args.preset_list]


def overlap_rows(args, cells: Dict[tuple, Cell], est: Optional[dict] = None) -> list:
    """Per (rate, preset pair): the link wait each exposes. With no limit the preset's
    step is compute plus arithmetic, L; at rate R it is S_R without overlap, O_R with:
    the link wait is S_R - L, of which O_R - L stays exposed with overlap (O_R - L_O,
    against the overlapped run with no limit, L_O, is shown beside it). ``waited``: what
    rank 0's training thread spent blocked on the overlapped reduce-scatters and
    all-gathers per step (the driver's ``wait_*_s``): the exposed wait's share that is
    waiting on the link, the rest of O_R - L being the passes' own slow-down."""
    predicted = {}
    if est is not None:
        predicted = {(r["rate"], r["preset"]): r["median"]["predicted_s"] for r in est["rows"]}
    rows = []
    for rate in args.rate_list:
        if rate is None:
            continue
        for preset in overlap_pairs(args):
            both = preset + OVERLAP
            loop, loop_o = cells[(None, preset)].median_step(), cells[(None, both)].median_step()
            s, o = cells[(rate, preset)].median_step(), cells[(rate, both)].median_step()
            row = {"rate": rate, "preset": preset, "L": loop, "L_O": loop_o, "S": s, "O": o,
                   "wait": s - loop, "exposed": o - loop, "exposed_vs_L_O": o - loop_o,
                   "waited": cells[(rate, both)].waited()}
            row["exposed_share"] = row["exposed"] / row["wait"] if row["wait"] > 0 else None
            row["round_shares"] = round_shares(cells[(None, preset)], cells[(rate, preset)],
                                               cells[(rate, both)])
            if predicted:
                row["predicted_wait"] = predicted[(rate, preset)] - predicted[(None, preset)]
                row["predicted_exposed"] = predicted[(rate, both)] - predicted[(None, preset)]
            rows.append(row)
    return rows


def round_shares(loop: Cell, plain: Cell, both: Cell) -> list:
    """The exposed share (O_R - L) / (S_R - L) of each round alone: its L, S_R and O_R runs
    are minutes apart, where the table's medians pool runs up to an hour apart. Their
    spread is how far one study can be trusted on a shared 2-core machine (L has moved by
    a tenth between rounds). Rounds pair from the end: a calibration run is the first of
    its cell. A round whose link wait is not positive has no share."""
    rounds = min(len(loop.runs), len(plain.runs), len(both.runs))
    shares = []
    for k in range(-rounds, 0):
        loop_s, plain_s, both_s = (statistics.median(cell.runs[k].step_times)
                                   for cell in (loop, plain, both))
        if plain_s > loop_s:
            shares.append((both_s - loop_s) / (plain_s - loop_s))
    return shares


def _shares_text(shares: list) -> str:
    if not shares:
        return "-"
    return (f"{100 * statistics.median(shares):.0f}% [{100 * min(shares):.0f}, "
            f"{100 * max(shares):.0f}]")


def overlap_table(args, cells: Dict[tuple, Cell], est: Optional[dict] = None) -> str:
    """The overlap study (docs/performance.md, "Overlap"): one row per (rate, preset)."""
    rows = overlap_rows(args, cells, est)
    if not rows:
        return ""
    head = ("| link | collectives | L s (no limit) | S_R s | O_R s (overlapped) "
            "| link wait S_R - L s | exposed O_R - L s | exposed share "
            "| exposed share per round: median [min, max] | O_R - L_O s "
            "| overlapped vs not | rank 0 waited RS + AG s |")
    lines = [head, "|---|---|" + "---:|" * 10]
    if est is not None:
        lines[0] += " predicted wait s | predicted exposed s |"
        lines[1] += "---:|---:|"
    for r in rows:
        share = "-" if r["exposed_share"] is None else f"{100 * r['exposed_share']:.0f}%"
        line = (f"| {rate_label(r['rate'])} | {PRESET_LABELS[r['preset']]} | {r['L']:.3f} "
                f"| {r['S']:.3f} | {r['O']:.3f} | {r['wait']:.3f} | {r['exposed']:.3f} | {share} "
                f"| {_shares_text(r['round_shares'])} | {r['exposed_vs_L_O']:.3f} | {r['S'] / r['O']:.2f}x "
                f"| {r['waited'][0]:.3f} + {r['waited'][1]:.3f} |")
        if est is not None:
            line += f" {r['predicted_wait']:.3f} | {r['predicted_exposed']:.3f} |"
        lines.append(line)
    return "\n".join(lines)


def write_json(path: str, command: str, probed: Probed, cells: Dict[tuple, Cell],
               est: Optional[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"command": command, "loopback_goodput_gbps": probed.loopback_gbps,
                   "goodput_gbps": {rate_label(r): g for r, g in probed.goodput.items()},
                   "loopback_latency_us": probed.loopback_latency_us,
                   "latency_us": {rate_label(r): u for r, u in probed.latency_us.items()},
                   "cells": [{"rate": rate, "preset": preset,
                              "step_times": [t for r in cell.runs for t in r.step_times],
                              "median_step_s": cell.median_step(),
                              "run_medians_s": cell.run_medians(),
                              "sent_per_step": [r.sent_per_step for r in cell.runs],
                              "sent_inter_per_step": [r.sent_inter_per_step for r in cell.runs],
                              "link_per_step": [r.link_per_step for r in cell.runs],
                              "load": [r.load for r in cell.runs],
                              "runs": [vars(r) for r in cell.runs]}
                             for (rate, preset), cell in cells.items()],
                   "estimate": est}, f, indent=1)


def replay(args) -> int:
    """Tables and estimator comparison of a ``--json`` file, without running anything."""
    with open(args.replay, encoding="utf-8") as f:
        data = json.load(f)
    command = data["command"].split()
    args.dtype = command[command.index("--dtype") + 1] if "--dtype" in command else "bf16"
    # the model the runs trained: their command's --num-layers, else the default
    layers = [a.split("=", 1)[1] if "=" in a else command[i + 1]
              for i, a in enumerate(command) if a.split("=", 1)[0] == "--num-layers"]
    args.num_layers = int(layers[-1]) if layers else NUM_LAYERS
    cells: Dict[tuple, Cell] = {}
    for c in data["cells"]:
        runs = c.get("runs") or [{"step_times": c["step_times"], "sent_per_step": c["sent_per_step"][0],
                                  "sent_inter_per_step": c["sent_inter_per_step"][0],
                                  "link_per_step": c["link_per_step"][0], "load": c["load"][0]}]
        cells[(c["rate"], c["preset"])] = Cell([RunResult(**run) for run in runs])
    args.preset_list = list(dict.fromkeys(preset for _, preset in cells))
    grid = [rate for rate in dict.fromkeys(rate for rate, _ in cells)
            if all((rate, preset) in cells for preset in args.preset_list)]
    args.rate_list, args.calibrate = grid, (None, args.preset_list[0]) in cells and None not in grid
    args.compute_s = None
    rates = list(dict.fromkeys(rate for rate, _ in cells))
    latency = data.get("latency_us") or {}  # files written before the latency probe: none
    print(f"replay of {args.replay} ({data['command']})")
    print()
    print(markdown_table(args, cells))
    print()
    goodput = data.get("goodput_gbps") or {}
    est = None
    if all(rate_label(rate) in goodput for rate in rates):
        probed = Probed(data["loopback_goodput_gbps"],
                        {rate: goodput[rate_label(rate)] for rate in rates},
                        data.get("loopback_latency_us") or 0.0,
                        {rate: latency[rate_label(rate)] for rate in rates
                         if rate_label(rate) in latency})
        est = estimate_rows(args, cells, probed)
        print_estimate(args, cells, est)
    else:  # a run with --probe off: no link figures for the estimator
        print("no estimator comparison: the runs did not probe their links (--probe off)")
        print()
    overlap = overlap_table(args, cells, est)
    if overlap:
        print(overlap)
        print()
    return 0
