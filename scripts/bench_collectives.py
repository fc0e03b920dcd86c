#!/usr/bin/env python
"""Time and bytes of each quantized collective vs the exact one, on local gloo ranks.

Runs ``--ranks`` CPU processes (default 4 = 2 emulated nodes x 2) and, for one
bucket of ``--numel`` elements, measures the median wall time of each variant
(max over ranks of each repeat) and the bytes each rank sent per level, from
``megatron_sdp4bit.comm.get_wire_stats``. Prints a markdown table; with
``--write-doc docs/performance.md`` it also replaces (or appends) that file's
"## Collectives" section.

On one machine the "network" is loopback memory copies, so times mostly
measure the quantization arithmetic; the byte columns are what carries over
to real links. The ranks are a torchrun job of the one collective benchmark,
``megatron_sdp4bit.benchmarks.collectives`` (run ``make setup`` first).

    python scripts/bench_collectives.py                    # 4 ranks, 1M elements
    python scripts/bench_collectives.py --numel 262144 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from megatron_sdp4bit.benchmarks.collectives import bytes_table, read_rows
from megatron_sdp4bit.jobs import job_env, torchrun_command

SECTION_HEADING = "## Collectives"
BEGIN, END = "<!-- bench_collectives:begin -->", "<!-- bench_collectives:end -->"


def write_doc_section(path: str, table: str, command: str) -> None:
    """Replace the table between this script's markers, or append a "## Collectives" section.

    Text outside the markers (the section's prose, other people's sections)
    is left as it is.
    """
    block = f"{BEGIN}\nProduced by `{command}`.\n\n{table}{END}"
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + f"{SECTION_HEADING}\n\n{block}\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--numel", type=int, default=1 << 20, help="bucket size in elements")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--write-doc", metavar="PATH", help="update this markdown file")
    parser.add_argument("--backend", choices=("gloo", "nccl", "auto"), default="gloo",
                        help="the ranks' process group (default gloo: CPU ranks); nccl needs "
                             "--ranks GPUs here, one per rank (megatron_sdp4bit.diagnostics.world)")
    args = parser.parse_args()
    if args.numel % args.ranks:
        parser.error(f"--numel must be a multiple of --ranks ({args.ranks})")
    command = torchrun_command(args.ranks, [
        "-m", "megatron_sdp4bit.benchmarks.collectives", "--cases", "variants",
        "--numel", args.numel, "--repeats", args.repeats, "--ranks-per-node", args.ranks_per_node,
        "--backend", args.backend])
    job = subprocess.run(command, env=job_env(), capture_output=True, text=True)
    rows = read_rows(job.stdout)
    if job.returncode or rows is None:
        print(f"bench_collectives: the ranks failed (exit {job.returncode}):\n"
              f"{(job.stdout + job.stderr)[-3000:]}", file=sys.stderr)
        return 1
    table = bytes_table(rows, args.ranks, args.ranks_per_node, args.numel, args.repeats,
                        rows[0].get("backend", "gloo"))
    print(table)
    if args.write_doc:
        command = "python scripts/bench_collectives.py " + " ".join(sys.argv[1:])
        write_doc_section(args.write_doc, table, command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
