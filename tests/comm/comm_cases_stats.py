"""Statistical cases, run inside every rank: unbiasedness over seeds, Hadamard on outliers."""
from __future__ import annotations

import torch
import torch.distributed as dist

from comm_cases_grads import exact_reduce_scatter, make_input, run_reduce_scatter
from megatron_sdp4bit.comm import reset_generators
from megatron_sdp4bit.config import SDP4BitConfig

SEEDS = 40


def unbiased_cases(rank: int, world: int, rpn: int, results: dict) -> None:
    """Average the output over SEEDS independent rounding streams.

    Unbiased rounding: the per-element mean error shrinks like 1/sqrt(SEEDS)
    (ratio ~0.16 here), and the signed total is a ~N(0,1) z-score. Nearest
    rounding is the control: the same error every time, ratio 1.
    """
    x = make_input(rank, 21, world * 512, torch.float32, integers=False)
    reference = exact_reduce_scatter(x, dist.ReduceOp.SUM).double()
    for mode, rounding in (("tlq-hs", "stochastic"), ("tlq", "stochastic"),
                           ("ulq", "stochastic"), ("tlq", "nearest")):
        config = SDP4BitConfig(grad_mode=mode, ranks_per_node=rpn, rounding=rounding)
        errors = []
        for seed in range(SEEDS):
            gen = torch.Generator().manual_seed(100_003 * seed + rank)
            out = run_reduce_scatter(x, config, dist.ReduceOp.SUM, generator=gen)
            errors.append(out.double() - reference)
        errors = torch.stack(errors)  # [seeds, shard]
        single = errors.abs().mean()
        mean_err = errors.mean(0)
        z = float(errors.sum() / errors.pow(2).sum().sqrt())
        results[f"unbiased|rpn={rpn}|{mode}|{rounding}"] = {
            "ratio": float(mean_err.abs().mean() / single) if single > 0 else 0.0,
            "z": z,
        }


def reproducible_cases(rank: int, world: int, rpn: int, results: dict) -> None:
    """Same seed -> same output after ``reset_generators``; another seed -> different output."""
    x = make_input(rank, 31, world * 640, torch.float32, integers=False)
    config = SDP4BitConfig(grad_mode="tlq-hs", ranks_per_node=rpn, seed=5)
    runs = []
    for cfg in (config, config, config.replace(seed=6)):
        reset_generators()
        runs.append(run_reduce_scatter(x, cfg, dist.ReduceOp.SUM))
    results[f"repro|rpn={rpn}"] = {"same_seed": torch.equal(runs[0], runs[1]),
                                  "other_seed_differs": not torch.equal(runs[0], runs[2])}


def hadamard_cases(rank: int, world: int, rpn: int, results: dict) -> None:
    """RMS error of TLq-HS vs TLq (same bits) on gradients with 100x outliers, and without."""
    for label, outliers in (("outliers", 100.0), ("gaussian", 0.0)):
        x = make_input(rank, 41, world * 4096, torch.float32, integers=False, outliers=outliers)
        reference = exact_reduce_scatter(x, dist.ReduceOp.SUM).double()
        rms = {}
        for mode in ("tlq-hs", "tlq"):
            config = SDP4BitConfig(grad_mode=mode, ranks_per_node=rpn)
            total = 0.0
            for seed in range(3):
                gen = torch.Generator().manual_seed(7 * seed + rank)
                out = run_reduce_scatter(x, config, dist.ReduceOp.SUM, generator=gen)
                total += float((out.double() - reference).pow(2).mean())
            rms[mode] = (total / 3) ** 0.5
        results[f"hadamard|rpn={rpn}|{label}"] = rms
