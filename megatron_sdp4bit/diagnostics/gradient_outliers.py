"""Where gradient outliers are: crest factors and 4-bit error of the inter-node groups.

    python -m megatron_sdp4bit.diagnostics.gradient_outliers --at 10 50 200 \\
        --json FILE -- <the driver's flags, e.g. make train's recipe>

Trains with the driver (``megatron_sdp4bit.pretrain``) in one process (one rank: the
gradient is what is measured, and with one data-parallel rank the gradient buffer
after the step holds the whole batch's gradient) and, after each iteration named
by ``--at``, cuts every bucket's gradient into the groups TLq-HS's inter-node hop
quantizes to 4 bits: ``--group-size`` (the config's ``grad_group_size_inter``, 128)
consecutive elements from the bucket's start, in the Hadamard domain of blocks of
``--hadamard-block`` (32) with the rotation, in the plain one without (TLq). Each
group gets the kind of the parameter most of its elements belong to
(``parameter_kind``). Per kind it reports:

- the crest factor of the groups, max |g| / rms(g) (1 for a flat group; sqrt(128)
  = 11.3 for a group holding one non-zero value): median, 99th percentile, max, and
  the share of groups above ``--crest-threshold`` (8: a group where one element
  carries about half the group's energy, max^2 / sum g^2 = 64/128), without and
  with the rotation;
- the 4-bit relative error ||Q(g) - g|| / ||g|| over the kind's groups without the
  rotation (TLq's 4-bit step: ``quant.quantize``) and with it (TLq-HS's:
  ``quant.hadamard_quantize`` then ``quant.dequantize_sum`` with the inverse
  transform), with ``--rounding`` (stochastic, the layer's; or nearest).

What this leaves out, by design: the 8-bit intra-node hop before (its error is
~16x smaller), and that the inter hop quantizes a node's partial sum rather than
the whole batch's gradient (the same kind of tensor, over fewer samples). The
gradient is read after megatron's clipping, a common factor per step that changes
neither a crest factor nor a relative error.

Prints a table per sampled iteration and writes ``--json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from megatron_sdp4bit import quant
from megatron_sdp4bit.megatron.quant_metrics import crest_factors, crest_summary

KINDS = ("embedding", "qkv", "attention output", "mlp fc1", "mlp fc2", "norm", "output layer",
         "other")
"""Parameter kinds, in table order; "other" is a name none of the rules knows."""
PADDING = len(KINDS)  # label of buffer elements no parameter owns

# (substring of megatron-core's parameter name, kind); the first match wins, so the
# layer norms fused into a linear layer (``linear_qkv.layer_norm_weight``) come first.
_NAME_RULES = (
    ("layer_norm", "norm"), ("layernorm", "norm"), ("embedding", "embedding"),
    ("linear_qkv", "qkv"), ("linear_q", "qkv"), ("linear_kv", "qkv"),
    ("linear_proj", "attention output"), ("linear_fc1", "mlp fc1"), ("linear_fc2", "mlp fc2"),
    ("output_layer", "output layer"),
)


def parameter_kind(name: str) -> str:
    """The kind of a megatron-core GPT parameter by its name (biases go with their
    layer: ``decoder.layers.0.mlp.linear_fc1.bias`` is "mlp fc1")."""
    for part, kind in _NAME_RULES:
        if part in name:
            return kind
    return "other"


def grouped(flat: torch.Tensor, group_size: int) -> torch.Tensor:
    """``flat`` as [groups, group_size], the last group zero-padded."""
    pad = -flat.numel() % group_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, group_size)


def group_kinds(labels: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group of ``labels`` (an element's kind index, PADDING where no parameter is):
    the kind most of its elements have, padding not counted (PADDING when all are)."""
    rows = grouped(labels.to(torch.long) + 1, group_size)  # 0 = the zero padding of grouped()
    counts = torch.zeros(rows.shape[0], PADDING + 2, dtype=torch.long)
    counts.scatter_add_(1, rows, torch.ones_like(rows))
    counts[:, 0] = counts[:, PADDING + 1] = 0  # neither kind of padding votes
    kinds = counts.argmax(dim=1) - 1
    kinds[counts.sum(dim=1) == 0] = PADDING
    return kinds


@dataclass(frozen=True)
class GroupFormat:
    """The inter-node hop's 4-bit groups (``SDP4BitConfig``'s defaults)."""

    bits: int = 4
    group_size: int = 128
    """``grad_group_size_inter``."""
    hadamard_block: int = 32
    rounding: str = "stochastic"

    def __post_init__(self):
        if self.group_size % self.hadamard_block:
            raise ValueError(f"group_size={self.group_size} must be a multiple of "
                             f"hadamard_block={self.hadamard_block}")


def roundtrip_errors(flat: torch.Tensor, fmt: GroupFormat,
                     generator: Optional[torch.Generator] = None) -> Dict[str, torch.Tensor]:
    """Q(g) - g of the whole of ``flat`` (fp32, a multiple of the group size), without
    the rotation (TLq's 4-bit step) and with it (TLq-HS's, back in the plain domain)."""
    plain = quant.dequantize(quant.quantize(flat, fmt.bits, fmt.group_size, fmt.rounding,
                                            generator))
    rotated_q = quant.hadamard_quantize(flat, fmt.bits, fmt.group_size, fmt.hadamard_block,
                                        fmt.rounding, generator)
    rotated = quant.dequantize_sum(rotated_q, 1, fmt.hadamard_block)
    return {"plain": plain - flat, "rotated": rotated - flat}


def relative_error(errors: torch.Tensor, values: torch.Tensor) -> float:
    """||errors|| / ||values|| (NaN when values are all zero)."""
    norm = values.to(torch.float64).norm()
    return float(errors.to(torch.float64).norm() / norm) if norm > 0 else float("nan")


def measure_buffer(flat: torch.Tensor, labels: torch.Tensor, fmt: GroupFormat, threshold: float,
                   generator: Optional[torch.Generator] = None) -> dict:
    """Per kind (and "all"): crest summaries without / with the rotation and the 4-bit
    relative errors of ``flat`` (whole groups, e.g. ``model_groups``; ``labels``: each
    element's kind index)."""
    flat = grouped(flat.detach().to(torch.float32).reshape(-1), fmt.group_size).reshape(-1)
    kinds = group_kinds(labels, fmt.group_size)
    plain_groups = flat.view(-1, fmt.group_size)
    rotated_groups = quant.hadamard_transform(flat, fmt.hadamard_block).view(-1, fmt.group_size)
    errors = {mode: e.view(-1, fmt.group_size)
              for mode, e in roundtrip_errors(flat, fmt, generator).items()}
    return _per_kind(kinds, plain_groups, rotated_groups, errors, threshold)


def _per_kind(kinds, plain_groups, rotated_groups, errors, threshold) -> dict:
    out = {}
    for index, kind in list(enumerate(KINDS)) + [(None, "all")]:
        rows = (kinds != PADDING) if index is None else (kinds == index)
        if not bool(rows.any()):
            continue
        values = plain_groups[rows]
        out[kind] = {
            "elements": int(values.numel()),
            "crest": crest_summary(crest_factors(values), threshold),
            "crest_rotated": crest_summary(crest_factors(rotated_groups[rows]), threshold),
            "error_tlq": relative_error(errors["plain"][rows], values),
            "error_tlq_hs": relative_error(errors["rotated"][rows], values),
        }
    return out


def bucket_labels(grad: torch.Tensor, named_params) -> torch.Tensor:
    """Each element's kind index in one bucket's gradient ``grad`` (PADDING where no
    parameter is): a parameter's ``main_grad`` (megatron's view into the bucket's
    buffer) is placed by its address."""
    labels = torch.full((grad.numel(),), PADDING, dtype=torch.int8)
    size = grad.element_size()
    for name, param in named_params:
        view = getattr(param, "main_grad", None)
        if view is None or view.dtype != grad.dtype:
            continue
        start = (view.data_ptr() - grad.data_ptr()) // size
        if 0 <= start < grad.numel():
            labels[start: start + view.numel()] = KINDS.index(parameter_kind(name))
    return labels


def model_groups(model_chunks, group_size: int) -> tuple:
    """(gradient, labels) of every bucket of the DDP ``model_chunks``, each bucket cut
    into whole groups from its start (its tail zero-padded, as PADDING) and the
    buckets concatenated: groups never straddle buckets, as on the wire. Copied to
    the CPU, so the torch reference (the specification) quantizes them on any device."""
    from megatron_sdp4bit.megatron.adapters import current_adapter

    adapter = current_adapter()
    grads, labels = [], []
    for chunk in model_chunks:
        named = list(chunk.named_parameters())
        for bucket_group in adapter.ddp_bucket_groups(chunk):
            for bucket in adapter.group_buckets(bucket_group):
                grad = adapter.bucket_grad_data(bucket).reshape(-1)
                pad = -grad.numel() % group_size
                grads += [grad.detach().to("cpu", torch.float32), torch.zeros(pad)]
                labels += [bucket_labels(grad, named), torch.full((pad,), PADDING, dtype=torch.int8)]
    return torch.cat(grads), torch.cat(labels)


class Sampler:
    """``on_step`` callback: measures the gradient after the iterations in ``at``."""

    def __init__(self, at: Sequence[int], fmt: GroupFormat, threshold: float, seed: int = 0):
        self.at, self.fmt, self.threshold = set(at), fmt, threshold
        self.generator = torch.Generator().manual_seed(seed)
        self.samples: List[dict] = []

    def __call__(self, run) -> None:
        if run.iteration not in self.at:
            return
        grad, labels = model_groups(run.parts.model, self.fmt.group_size)
        kinds = measure_buffer(grad, labels, self.fmt, self.threshold, self.generator)
        grad_norm = None if run.grad_norm is None else float(run.grad_norm)
        self.samples.append({"iteration": run.iteration, "grad_norm": grad_norm, "kinds": kinds})


def table(sample: dict, threshold: float, group_size: int) -> str:
    """One sampled iteration as a text table."""
    norm = "-" if sample["grad_norm"] is None else f"{sample['grad_norm']:.3g}"
    head = (f"iteration {sample['iteration']} (grad norm {norm}): crest = max|g|/rms "
            f"per {group_size}-element group; share > {threshold:g}; 4-bit relative error")
    lines = [head, f"{'kind':<17}{'elements':>10}  {'crest med/p99/max':>20} {'share':>7}  "
             f"{'rotated med/p99/max':>20} {'share':>7}  {'err TLq':>8} {'TLq-HS':>7}"]

    def crest(c):
        if not c.get("groups"):
            return f"{'-':>20} {'-':>7}"
        return f"{c['median']:6.2f}/{c['p99']:6.2f}/{c['max']:6.2f} {c['share_above']:7.2%}"

    for kind, row in sample["kinds"].items():
        lines.append(f"{kind:<17}{row['elements']:>10}  {crest(row['crest'])}  "
                     f"{crest(row['crest_rotated'])}  {row['error_tlq']:8.4f} {row['error_tlq_hs']:7.4f}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, driver = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", type=int, nargs="+", required=True, help="iterations to sample after")
    parser.add_argument("--crest-threshold", type=float, default=8.0)
    parser.add_argument("--group-size", type=int, default=GroupFormat.group_size)
    parser.add_argument("--hadamard-block", type=int, default=GroupFormat.hadamard_block)
    parser.add_argument("--rounding", default=GroupFormat.rounding, choices=("stochastic", "nearest"))
    parser.add_argument("--seed", type=int, default=0, help="the stochastic rounding's generator")
    parser.add_argument("--json", default=None, help="write the samples here")
    args = parser.parse_args(own)
    from megatron_sdp4bit.pretrain import run
    from megatron_sdp4bit.training.arguments import parse_args
    from megatron_sdp4bit.training.distributed import shutdown

    driver_args = parse_args(driver)
    late = [at for at in args.at if not 1 <= at <= driver_args.train_iters]
    if late:
        parser.error(f"--at {late}: outside iterations 1..{driver_args.train_iters} (--train-iters)")
    try:
        fmt = GroupFormat(group_size=args.group_size, hadamard_block=args.hadamard_block,
                          rounding=args.rounding)
    except ValueError as exc:
        parser.error(f"--group-size / --hadamard-block: {exc}")
    sampler = Sampler(args.at, fmt, args.crest_threshold, args.seed)
    try:
        run(driver_args, on_step=sampler)
    finally:
        shutdown()
    for sample in sampler.samples:
        print(table(sample, args.crest_threshold, fmt.group_size), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"format": vars(fmt), "crest_threshold": args.crest_threshold,
                       "driver_flags": driver, "samples": sampler.samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
