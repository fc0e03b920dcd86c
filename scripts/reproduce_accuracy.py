#!/usr/bin/env python3
"""The paper's accuracy comparison (Table 1): seven ways to communicate, several seeds each.

Every configuration trains the same model on the same data with the same schedule
through the driver; only the data-parallel collectives differ:

    baseline   exact all-gather and fp32 reduce-scatter
    qW         4-bit weights (quantized directly), exact gradients
    qWD        4-bit weight differences, exact gradients
    TLq        exact weights, two-level 8/4-bit gradients
    TLq-HS     exact weights, two-level 8/4-bit gradients with Hadamard smoothing
    SDP4Bit    qWD + TLq-HS (the paper's method)
    ZeRO++     qW + ULq (4/4-bit gradients, no Hadamard)

Seed s sets the model's initialisation and data order (--seed) and the
stochastic-rounding streams (--sdp4bit-seed), the same s for every configuration,
so differences can be compared seed by seed.

Each finished run writes ``OUT/results/<config>-seed<s>.json`` (final validation
loss, the curves, and the commit it ran on with whether the tree was dirty); a rerun skips finished runs, so the study can be completed
over several sittings (``--max-runs`` bounds one sitting). Then, and with
``--analyze``, it writes ``OUT/summary.json``, ``OUT/table.md`` and
``OUT/validation_curves.png``. When the runs span commits, the table says so and
names the steps between them that change the quantizers or collectives
(``megatron_sdp4bit.study_commits``): a table mixing code that computes differently
cannot pass for a current one.

Recipes:

    cpu       (default) recipes.ACCURACY_CPU: a 2 x 128 GPT (1.46 M parameters) in fp32,
              400 steps of 16 x 128 tokens of the embedded corpus, on 4 CPU ranks as
              2 emulated nodes x 2; about 3 minutes per run on 2 cores alone
    cpu-outliers
              recipes.ACCURACY_CPU_OUTLIERS: make train's 4 x 256 GPT at lr 1e-2, 400
              steps, the same 4 ranks: gradients whose 4-bit groups carry outliers, where
              the Hadamard rotation has something to do; about 8 minutes per run
              (``--configs baseline TLq TLq-HS`` for the rotation's ablation alone)
    gpu-125m  configs/gpt_125m.yaml (and gpu-350m, gpu-1.3b) on one node of GPUs
              (``--gpus``, default 8, as 2 emulated nodes unless --ranks-per-node), with
              ``--data-path`` prepared by sdp4bit-preprocess and GPT-2's vocabulary:
              extra driver flags after ``--``; each run checkpoints every
              ``--checkpoint-interval`` steps and resumes after an interruption

Run ``make setup`` first (the driver and the recipes are the installed package's).

    python scripts/reproduce_accuracy.py --seeds 1 2 3
    python scripts/reproduce_accuracy.py --analyze
    python scripts/reproduce_accuracy.py --recipe gpu-125m --out runs/accuracy-125m -- \\
        --data-path pile_text_document --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from typing import Optional

from megatron_sdp4bit import recipes
from megatron_sdp4bit.jobs import run_driver
from megatron_sdp4bit.study_commits import commit_note, git_changes_arithmetic, run_commit
from megatron_sdp4bit.training.figures import axis_labels, pyplot, save_figure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (flags, the paper's Table 1 final validation loss at 125M)
CONFIGS = {
    "baseline": (["--sdp4bit-preset", "baseline"], 2.29392),
    "qW": (["--sdp4bit-preset", "baseline", "--sdp4bit-weight-mode", "direct"], 2.57312),
    "qWD": (["--sdp4bit-preset", "qwd-only"], 2.29274),
    "TLq": (["--sdp4bit-preset", "tlq-hs-only", "--sdp4bit-grad-mode", "tlq"], 2.30479),
    "TLq-HS": (["--sdp4bit-preset", "tlq-hs-only"], 2.29528),
    "SDP4Bit": (["--sdp4bit-preset", "sdp4bit"], 2.29590),
    "ZeRO++": (["--sdp4bit-preset", "zeropp"], None),
}


# The CPU recipes (megatron_sdp4bit.recipes: why this size, this length), all on 4
# ranks as 2 emulated nodes x 2.
CPU_RANKS, CPU_RANKS_PER_NODE = recipes.ACCURACY_CPU_RANKS, recipes.ACCURACY_CPU_RANKS_PER_NODE
CPU_RUN_TIMEOUT_S = 4 * 3600  # a CPU run takes minutes: a hung one is stopped
CPU_RECIPES = {"cpu": recipes.ACCURACY_CPU, "cpu-outliers": recipes.ACCURACY_CPU_OUTLIERS}
GPU_RECIPES = ("gpu-125m", "gpu-350m", "gpu-1.3b")


def recipe_flags(recipe: str, gpus: int, ranks_per_node: int) -> tuple[list, int]:
    """(driver flags shared by every run, ranks) of a recipe."""
    if recipe in CPU_RECIPES:
        return (CPU_RECIPES[recipe].flags() + ["--sdp4bit-ranks-per-node", str(CPU_RANKS_PER_NODE)],
                CPU_RANKS)
    size = recipe.split("-", 1)[1]
    config = os.path.join(ROOT, "configs", f"gpt_{size}.yaml")
    if not os.path.isfile(config):
        raise SystemExit(f"--recipe {recipe}: no {config}")
    return ["--config", config, "--sdp4bit-ranks-per-node", str(ranks_per_node)], gpus


def run_name(config: str, seed: int) -> str:
    return f"{config}-seed{seed}"


def study_fingerprint(flags: list) -> str:
    return hashlib.sha256(json.dumps(flags).encode()).hexdigest()[:16]


def run_one(out: str, config: str, seed: int, shared: list, ranks: int, fingerprint: str,
            checkpoint_interval: int = 0, timeout: Optional[float] = CPU_RUN_TIMEOUT_S) -> dict:
    """Train one configuration with one seed; write and return its result.

    ``checkpoint_interval`` > 0 (GPU recipes: runs of many hours): the run saves
    every that many steps and an interrupted run resumes from its last checkpoint
    (deleted once the run has finished); 0: an unfinished run starts again.
    ``timeout``: seconds before a run is stopped (None: never).
    """
    name = run_name(config, seed)
    run_dir = os.path.join(out, "runs", name)
    checkpoints = os.path.join(out, "checkpoints", name)
    flags = shared + CONFIGS[config][0] + ["--seed", str(seed), "--sdp4bit-seed", str(seed),
                                           "--run-dir", run_dir]
    if checkpoint_interval:
        flags += ["--save", checkpoints, "--load", checkpoints,
                  "--save-interval", str(checkpoint_interval)]
    elif os.path.isdir(run_dir):  # an unfinished earlier attempt: start it again
        shutil.rmtree(run_dir)
    # The code the run imports is the checkout's when it starts (recorded at the end,
    # a commit made meanwhile was taken for the one it ran on); a checkout that
    # changes while it runs may have mixed both: counted as uncommitted code.
    code = run_commit(ROOT)
    job = run_driver(flags, os.path.join(out, "logs", name + ".log"), ranks=ranks,
                     timeout=timeout, cwd=ROOT)
    if job.returncode != 0:
        raise RuntimeError(f"{name} exited {job.returncode}; log {job.log_path}:\n{job.tail()}")
    from megatron_sdp4bit.training.metrics import group_shape_means, loss_curves

    metrics = os.path.join(run_dir, "metrics.jsonl")
    curve = {kind: [list(point) for point in points] for kind, points in loss_curves(metrics).items()}
    if not curve["valid"]:
        raise RuntimeError(f"{name} logged no validation loss; log {job.log_path}")
    last = curve["train"][-1][0]
    result = {"config": config, "seed": seed, "final_valid_loss": curve["valid"][-1][1],
              "final_train_loss": curve["train"][-1][1], "curves": curve,
              # the 4-bit gradient groups' shape over the second half (quantized runs only)
              "grad_groups": group_shape_means(metrics, after_iteration=last // 2),
              "seconds": round(job.seconds, 1), "flags": flags, "fingerprint": fingerprint,
              **code, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    if run_commit(ROOT) != code:
        result["dirty"] = True
    path = os.path.join(out, "results", name + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(path + ".part", path)  # written whole or not at all
    shutil.rmtree(checkpoints, ignore_errors=True)
    return result


def load_results(out: str, fingerprint: str) -> dict:
    """``{(config, seed): result}`` of finished runs; refuses results of another recipe."""
    results = {}
    folder = os.path.join(out, "results")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".json"):
            continue
        with open(os.path.join(folder, name)) as f:
            result = json.load(f)
        if result["fingerprint"] != fingerprint:
            raise SystemExit(f"{folder}/{name} was run with other flags (recipe fingerprint "
                             f"{result['fingerprint']}, now {fingerprint}): use another --out, or "
                             "delete the old results to rerun them")
        if "grad_groups" not in result:  # a run finished before results kept them
            from megatron_sdp4bit.training.metrics import group_shape_means

            metrics = os.path.join(out, "runs", run_name(result["config"], result["seed"]),
                                   "metrics.jsonl")
            last = result["curves"]["train"][-1][0]
            result["grad_groups"] = group_shape_means(metrics, last // 2) if os.path.isfile(metrics) else {}
        results[(result["config"], result["seed"])] = result
    return results


# --- analysis --------------------------------------------------------------------------

def summarize(results: dict) -> dict:
    """Per configuration: mean and standard deviation of the final validation loss, the
    difference from baseline, and the seed-by-seed (paired) difference with its spread."""
    base = {seed: r["final_valid_loss"] for (c, seed), r in results.items() if c == "baseline"}
    summary = {}
    for config, (_, paper) in CONFIGS.items():
        losses = {seed: r["final_valid_loss"] for (c, seed), r in results.items() if c == config}
        if not losses:
            continue
        values = list(losses.values())
        row = {"n": len(values), "seeds": sorted(losses), "mean": statistics.fmean(values),
               "std": statistics.stdev(values) if len(values) > 1 else math.nan, "paper": paper}
        if base and config != "baseline":
            row["vs_baseline_pct"] = 100 * (row["mean"] / statistics.fmean(base.values()) - 1)
            paired = [losses[s] - base[s] for s in losses if s in base]
            if len(paired) > 1:
                mean, sd = statistics.fmean(paired), statistics.stdev(paired)
                row["paired_diff_mean"], row["paired_diff_std"] = mean, sd
                # beyond 2 standard errors of the seed-by-seed differences
                row["exceeds_seed_spread"] = abs(mean) > 2 * sd / math.sqrt(len(paired))
        if paper is not None and config != "baseline":
            row["paper_vs_baseline_pct"] = 100 * (paper / CONFIGS["baseline"][1] - 1)
        summary[config] = row
    return summary


def table(summary: dict) -> str:
    lines = ["| configuration | paper 125M | paper vs baseline | ours: final validation loss "
             "(mean +- std, n) | vs baseline | seed-by-seed difference | beyond the seed spread? |",
             "|---|---:|---:|---|---:|---|---|"]
    for config, r in summary.items():
        paper = f"{r['paper']:.5f}" if r["paper"] is not None else "-"
        paper_pct = f"{r['paper_vs_baseline_pct']:+.2f}%" if "paper_vs_baseline_pct" in r else "-"
        ours = f"{r['mean']:.4f} +- {r['std']:.4f} ({r['n']})"
        pct = f"{r['vs_baseline_pct']:+.2f}%" if "vs_baseline_pct" in r else "-"
        paired = (f"{r['paired_diff_mean']:+.4f} +- {r['paired_diff_std']:.4f}"
                  if "paired_diff_mean" in r else "-")
        beyond = {True: "yes", False: "no"}.get(r.get("exceeds_seed_spread"), "-")
        lines.append(f"| {config} | {paper} | {paper_pct} | {ours} | {pct} | {paired} | {beyond} |")
    return "\n".join(lines)


def group_shape_table(results: dict) -> Optional[str]:
    """The gradients' 4-bit groups as the runs that quantized them sampled them (every
    logged step of the second half of training, averaged per run, then over seeds): do
    they carry outliers (crest factor max|g| / rms over groups of 128; above 8, one
    element holds about half a group's energy), and what the Hadamard rotation does to
    the 4-bit error there. None when no run sampled them."""
    rows = []
    for config in CONFIGS:
        runs = [r["grad_groups"] for (c, _), r in sorted(results.items())
                if c == config and r.get("grad_groups")]
        if not runs:
            continue
        mean = {field: statistics.fmean(run[field] for run in runs) for field in runs[0]}
        rows.append(f"| {config} | {len(runs)} | {mean['grad_crest_median']:.2f} | "
                    f"{mean['grad_crest_p99']:.2f} | {100 * mean['grad_crest_share_above_8']:.2f}% | "
                    f"{mean['grad_4bit_error_tlq']:.3f} | {mean['grad_4bit_error_tlq_hs']:.3f} |")
    if not rows:
        return None
    return "\n".join(["4-bit gradient groups, second half of training (sampled on logged steps; "
                      "mean over runs):", "",
                      "| configuration | runs | crest median | crest p99 | groups above 8 | "
                      "4-bit error TLq | 4-bit error TLq-HS |", "|---|---:|---:|---:|---:|---:|---:|",
                      *rows])


def plot(results: dict, path: str, title: str):
    """Left: every configuration's validation curve, mean with a +-std band over seeds.
    Right: its seed-by-seed difference from baseline in %, which the left panel's
    overlapping curves hide."""
    if not results:
        return None
    plt = pyplot()
    if plt is None:
        return None
    base = {seed: dict(map(tuple, r["curves"]["valid"]))
            for (c, seed), r in results.items() if c == "baseline"}
    fig, (ax, diff_ax) = plt.subplots(1, 2, figsize=(13, 5))
    for config in CONFIGS:
        runs = {seed: dict(map(tuple, r["curves"]["valid"]))
                for (c, seed), r in results.items() if c == config}
        if not runs:
            continue
        steps = sorted(set.intersection(*(set(run) for run in runs.values())))
        means = [statistics.fmean(run[it] for run in runs.values()) for it in steps]
        spread = [statistics.stdev([run[it] for run in runs.values()]) if len(runs) > 1 else 0.0
                  for it in steps]
        line, = ax.plot(steps, means, "o-", label=f"{config} ({len(runs)} seeds)", markersize=3)
        ax.fill_between(steps, [m - s for m, s in zip(means, spread)],
                        [m + s for m, s in zip(means, spread)], color=line.get_color(), alpha=0.15)
        paired = [seed for seed in runs if seed in base]
        if config == "baseline" or not paired:
            continue
        shared = [it for it in steps if all(it in base[seed] for seed in paired)]
        pct = [statistics.fmean(100 * (runs[seed][it] / base[seed][it] - 1) for seed in paired)
               for it in shared]
        diff_ax.plot(shared, pct, "o-", color=line.get_color(), markersize=3,
                     label=f"{config} ({len(paired)} seeds)")
    axis_labels(ax, "iteration", "validation loss (mean +- std over seeds)", title)
    diff_ax.axhline(0.0, color="black", linewidth=0.8)
    axis_labels(diff_ax, "iteration", "vs baseline, same seed (%, mean over seeds)",
                "Difference from the exact collectives")
    return save_figure(fig, [ax, diff_ax], path, dpi=110)


def code_note(results: dict, changes_arithmetic=None) -> Optional[str]:
    """The line under the table when the runs span commits (naming those whose
    quantizers or collectives differ) or ran on uncommitted changes; None otherwise."""
    in_order = sorted(results.values(), key=lambda r: r.get("finished", ""))
    return commit_note(in_order, changes_arithmetic or git_changes_arithmetic(ROOT))


def analyze(out: str, fingerprint: str, recipe: str) -> dict:
    results = load_results(out, fingerprint)
    summary = summarize(results)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    note = code_note(results)
    groups = group_shape_table(results)
    text = table(summary) + (f"\n\n{note}" if note else "") + (f"\n\n{groups}" if groups else "")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    png = plot(results, os.path.join(out, "validation_curves.png"),
               f"Validation loss, recipe {recipe}")
    print(text)
    if png:
        print(f"curves: {png}")
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--recipe", default="cpu", choices=(*CPU_RECIPES, *GPU_RECIPES))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", default=None, help="default runs/accuracy-<recipe>")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs")
    p.add_argument("--analyze", action="store_true", help="only summarize the finished runs")
    p.add_argument("--gpus", type=int, default=8, help="GPU recipes: ranks on this node")
    p.add_argument("--checkpoint-interval", type=int, default=1000,
                   help="GPU recipes: each run saves every this many steps and an interrupted "
                   "run resumes from its last checkpoint (0: it starts again)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="GPU recipes: ranks per emulated node (default half of --gpus)")
    p.add_argument("driver_flags", nargs="*", help="after --: extra driver flags (GPU recipes: data)")
    args = p.parse_args(argv)
    if any(s < 0 for s in args.seeds):
        p.error("--seeds must be non-negative integers")
    if args.checkpoint_interval < 0:
        p.error("--checkpoint-interval must be >= 0")
    if args.recipe not in CPU_RECIPES and not args.analyze and "--data-path" not in args.driver_flags:
        p.error(f"--recipe {args.recipe} needs -- --data-path PREFIX (sdp4bit-preprocess) and the "
                "tokenizer flags")
    args.out = args.out or os.path.join(ROOT, "runs", f"accuracy-{args.recipe}")
    args.ranks_per_node = args.ranks_per_node or max(1, args.gpus // 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    shared, ranks = recipe_flags(args.recipe, args.gpus, args.ranks_per_node)
    shared = shared + list(args.driver_flags)
    fingerprint = study_fingerprint(shared)
    for folder in ("results", "logs", "runs"):
        os.makedirs(os.path.join(args.out, folder), exist_ok=True)
    if not args.analyze:
        done = load_results(args.out, fingerprint)
        todo = [(c, s) for s in args.seeds for c in args.configs if (c, s) not in done]
        print(f"[accuracy] {len(done)} runs finished in {args.out}, {len(todo)} to go", flush=True)
        for index, (config, seed) in enumerate(todo[: args.max_runs]):
            started = time.perf_counter()
            on_cpu = args.recipe in CPU_RECIPES  # minutes per run; GPU runs take hours
            result = run_one(args.out, config, seed, shared, ranks, fingerprint,
                             checkpoint_interval=0 if on_cpu else args.checkpoint_interval,
                             timeout=CPU_RUN_TIMEOUT_S if on_cpu else None)
            print(f"[accuracy] {index + 1}/{len(todo)} {run_name(config, seed)}: final validation "
                  f"loss {result['final_valid_loss']:.4f} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    analyze(args.out, fingerprint, args.recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
