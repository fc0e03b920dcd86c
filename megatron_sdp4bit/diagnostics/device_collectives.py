"""The quantized collectives on this machine's devices, against the CPU reference.

    torchrun --nproc-per-node 4 -m megatron_sdp4bit.diagnostics.device_collectives \
        --ranks-per-node 2 [--device cuda] [--backend auto|gloo|nccl] [--levels 1|2|both] \
        [--shard 1048576] [--json FILE]

``--backend`` (``diagnostics/world.py``): on gloo the ranks share the visible GPUs
(local rank r on GPU r mod their count, so one GPU runs 4 ranks); on nccl (the
default where this node's 2 or more ranks each have a GPU) the world is
``"cpu:gloo,cuda:nccl"`` and each rank has ``cuda:LOCAL_RANK``, so the checked
collectives run over NCCL as in a training job: a user's self-check of a cluster
before the first job (README, "First run on a cluster"). Each rank runs every case
twice on the same inputs: on ``--device`` tensors (the Triton kernels on CUDA, the
collectives' bytes staged through host memory by gloo) and on CPU tensors (the torch
reference, the specification). With ``--ranks-per-node 2`` of 4 ranks the gradient
reduce-scatter runs both hops (8-bit inside an emulated node, 4-bit across).

Per case: the SDP4Bit reduce-scatter (TLq-HS) and the qWD weight all-gather; fp32
and bf16; synchronous with 1 pipeline chunk, asynchronous with 4 (and the two
mixed); an unaligned shard and a large one. The asynchronous calls on ``--device``
go to the runner the patch layer picks for that backend and device
(``comm.runner_choice.runner_kind``): on gloo a worker thread (``ThreadRunner`` on a private
twin of the world group; on CUDA with its own side stream), on NCCL a side stream
(``StreamRunner``); with ``--runner deferred`` on the runner the layer takes on NCCL
under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (``DeferringRunner``: a case's async call is
submitted, then waited on, so its stages are issued by the wait; its sync calls on
``--device`` go through it too, a bucket of up to 64 M elements in one chunk). With
``--runner stream`` (CUDA only) the async calls go to the NCCL runner whatever the
backend: on gloo, where one GPU can host several ranks, that checks its stream order on
a real device (the side stream after the caller's work: every input is written last on
the compute stream, behind a GPU sleep; the caller after the side stream in ``wait()``).
gloo blocks the host in each hop, so a submission returns only once its last hop is
done: the host's early return and the inputs' lifetime (``record_stream``) are what it
cannot check; the stages' order on the stream is the one NCCL gets. What must hold:

- nearest rounding: the device result equals the CPU reference bit for bit;
- an asynchronous call's result equals the synchronous call's on the same inputs
  and noise, bit for bit (both roundings: the noise streams restart for each run);
- stochastic rounding: every element within the error bound the collectives state
  (``comm/error_bounds.py``), and after a weight all-gather every rank holds the same
  bytes;
- on CUDA, one more case: the runner's side stream outranks the compute stream, as
  the device reports the two priorities (``comm.runner.side_stream``).

``--levels``: the reduce-scatter with the world as one node (8-bit only), with
nodes of ``--ranks-per-node`` (two levels; needs fewer ranks per node than ranks),
or both (the default). The exact answer each case is measured against is the
float64 sum of every rank's input, gathered with torch's exact all-gather.

Exit status 0 when every case holds, 1 when one fails, 2 when the backend cannot
run here (one line saying what to change); rank 0 prints one line per case.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm import (
    forget_subgroups,
    quantized_all_gather_weights,
    quantized_reduce_scatter,
)
from megatron_sdp4bit.comm.rounding_streams import reset_generators
from megatron_sdp4bit.comm.error_bounds import reduce_scatter_bound, tolerance, weight_bound
from megatron_sdp4bit.comm.runner_choice import make_runner, runner_kind
from megatron_sdp4bit.comm.topology import build_private_groups, get_topology, private_group
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.diagnostics.world import (
    BACKEND_HELP, BACKENDS, Machine, WorldError, choose_backend, start_world)

RUNNERS = ("layer", "stream", "deferred")  # layer: comm.runner_choice.runner_kind's choice
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCHEDULES = ((False, 1), (True, 4), (False, 4), (True, 1))  # (async_op, pipeline chunks)
ROUNDINGS = ("nearest", "stochastic")
CHECKS = {  # what must hold besides the error bound, as the table says it
    "identical_to_reference": "bit-identical to the CPU reference",
    "async_identical_to_sync": "async bit-identical to sync",
    "replicas_identical": "replicas identical",
    "side_stream_outranks_compute": "side stream outranks the compute stream",
}


def _rank_input(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's gradients: normal values with a few 50x outliers (what Hadamard is for)."""
    gen = torch.Generator().manual_seed(seed * 1009 + dist.get_rank())
    x = torch.randn(numel, generator=gen)
    x[torch.rand(numel, generator=gen) < 0.002] *= 50
    return x.to(dtype)


# A runner's side stream must start after the caller's work so far (``comm/runner.py``):
# on CUDA every checked input is written last by the compute stream, behind this many GPU
# cycles of sleep (about 10 ms), so a side stream that did not wait would read zeros.
LATE_INPUT_CYCLES = 20_000_000


def _on_device(t: torch.Tensor, where: torch.device) -> torch.Tensor:
    """A copy of ``t`` on ``where``; on CUDA its bytes land late on the compute stream."""
    if where.type != "cuda":
        return t.clone()
    staged = t.to(where)
    late = torch.zeros_like(staged)
    torch.cuda._sleep(LATE_INPUT_CYCLES)
    late.copy_(staged)
    return late


def _finish(handle) -> None:
    if handle is not None:
        handle.wait()


def _same_bytes_everywhere(t: torch.Tensor) -> bool:
    digest = hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    everyone: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest)
    return len(set(everyone)) == 1


def _on(where, device, async_op: bool, runner) -> dict:
    """The async calls on the checked device go to the runner, on its private group; so
    do the sync ones where the runner chooses the chunks itself (``DeferringRunner``): the
    synchronous reference then takes the same chunks, the same rounding draws."""
    if where == device and (async_op or runner.whole_bucket_elements is not None):
        return dict(async_op=async_op, runner=runner, group=runner.group_for(dist.group.WORLD))
    return dict(async_op=async_op)


def reduce_scatter_case(device, dtype, async_op, chunks, rounding, shard, rpn, seed,
                        runner) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    config = SDP4BitConfig(ranks_per_node=rpn, pipeline_chunks=chunks, rounding=rounding)
    op = dist.ReduceOp.AVG if async_op else dist.ReduceOp.SUM
    x = _rank_input(seed, world * shard, dtype)

    def run(where, is_async):
        reset_generators()  # the same noise for every run: async and sync are comparable
        out = torch.empty(shard, dtype=dtype, device=where)
        _finish(quantized_reduce_scatter(out, _on_device(x, where), op=op, config=config,
                                         **_on(where, device, is_async, runner)))
        return out.cpu()

    outputs = {where.type: run(where, async_op) for where in (device, torch.device("cpu"))}
    result = {}
    if async_op:
        result["async_identical_to_sync"] = torch.equal(outputs[device.type], run(device, False))
    if rounding == "nearest":
        result["identical_to_reference"] = torch.equal(outputs[device.type], outputs["cpu"])
    everyone = [torch.empty(world * shard) for _ in range(world)]
    dist.all_gather(everyone, x.float())
    inputs = torch.stack(everyone)
    exact = inputs.double().view(world, world, shard)[:, rank].sum(0)
    if op == dist.ReduceOp.AVG:
        exact /= world
    bound = reduce_scatter_bound(inputs, rank, config, world // rpn, op == dist.ReduceOp.AVG)
    tol = tolerance(bound, exact, float(inputs.abs().amax(1).sum()), dtype)
    result["bound_ratio"] = float(((outputs[device.type].double() - exact).abs() / tol).max())
    return result


def all_gather_case(device, dtype, async_op, rounding, shard, rpn, seed, runner) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    config = SDP4BitConfig(ranks_per_node=rpn, rounding=rounding)
    model = torch.randn(world * shard, generator=torch.Generator().manual_seed(seed)).to(dtype)
    own = model[rank * shard:(rank + 1) * shard]
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    main = own.float() + 0.01 * torch.randn(shard, generator=gen)  # one optimizer step's change

    def run(where, is_async):
        reset_generators()  # the same noise for every run: async and sync are comparable
        buffer = _on_device(model, where)
        _finish(quantized_all_gather_weights(buffer, _on_device(main, where), config=config,
                                             **_on(where, device, is_async, runner)))
        return buffer.cpu()

    buffers = {where.type: run(where, async_op) for where in (device, torch.device("cpu"))}
    result = {"replicas_identical": _same_bytes_everywhere(buffers[device.type])}
    if async_op:
        result["async_identical_to_sync"] = torch.equal(buffers[device.type], run(device, False))
    if rounding == "nearest":
        result["identical_to_reference"] = torch.equal(buffers[device.type], buffers["cpu"])
    new_own = buffers[device.type][rank * shard:(rank + 1) * shard].double()
    bound = weight_bound(main, main - own.float(), config.weight_bits, config.weight_group_size, dtype)
    result["bound_ratio"] = float(((new_own - main.double()).abs() / bound).max())
    return result


def runner_case(runner, device: torch.device) -> Optional[dict]:
    """On CUDA, the runner's side stream outranks the compute stream, as the device reports
    it (``comm.runner.side_stream``): a priority the device did not take would hold the
    collectives' kernels behind the passes' without any error. None without a side stream."""
    stream = getattr(runner, "stream", None)
    if device.type != "cuda" or stream is None:
        return None
    compute = torch.cuda.current_stream(device).priority
    return {"collective": "runner", "bound_ratio": None,
            "case": f"{runner.kind} side stream priority {stream.priority} (compute {compute})",
            "side_stream_outranks_compute": stream.priority < compute}


def passed(result: dict) -> bool:
    return ((result["bound_ratio"] is None or result["bound_ratio"] <= 1.0)
            and all(result.get(key, True) for key in CHECKS))


def level_counts(choice: str, world: int, ranks_per_node: int) -> List[int]:
    """The ranks-per-node values that run ``--levels``: the world as one node is one level
    (8-bit reduce-scatter only), ``ranks_per_node`` < world is two (8-bit inside, 4-bit across)."""
    one, two = [world], ([ranks_per_node] if ranks_per_node < world else [])
    if choice == "2" and not two:
        raise ValueError(f"--levels 2 needs --ranks-per-node below the {world} ranks")
    return {"1": one, "2": two, "both": one + two}[choice]


def run_cases(device: torch.device, shards, rpns: List[int], runner) -> List[dict]:
    cases = []
    world = dist.get_world_size()
    combos = itertools.product(rpns, DTYPES.items(), SCHEDULES, ROUNDINGS, shards)
    for seed, (rpn, (dname, dtype), (async_op, chunks), rounding, shard) in enumerate(combos):
        name = (f"levels={1 if rpn == world else 2} {dname} {'async' if async_op else 'sync'} "
                f"chunks={chunks} {rounding} shard={shard}")
        rs = reduce_scatter_case(device, dtype, async_op, chunks, rounding, shard, rpn, seed,
                                 runner)
        cases.append(dict(rs, collective="reduce_scatter", case=name))
        if chunks == 1:  # the all-gather has no pipeline chunks
            ag = all_gather_case(device, dtype, async_op, rounding, shard, rpn, seed, runner)
            cases.append(dict(ag, collective="all_gather", case=name.replace(" chunks=1", "")))
    for case in cases:
        case["passed"] = passed(case)
    return cases


def _describe(case: dict) -> str:
    parts = [] if case["bound_ratio"] is None else [f"bound ratio {case['bound_ratio']:.3f}"]
    for key, words in CHECKS.items():
        if key in case:
            parts.append(words if case[key] else "NOT " + words)
    return (f"[{'PASS' if case['passed'] else 'FAIL'}] {case['collective']:14s} {case['case']}: "
            + ", ".join(parts))


def summary_table(cases: List[dict]) -> str:
    """One row per collective and level count: cases, failures, the worst bound ratio."""
    rows = {}
    for case in cases:
        key = (case["collective"], case["case"].split()[0])
        rows.setdefault(key, []).append(case)
    lines = [f"{'collective':14s} {'levels':8s} {'cases':>5s} {'failed':>6s} {'worst bound':>11s}  result"]
    for (collective, levels), group in rows.items():
        failed = sum(not c["passed"] for c in group)
        worst = max(c["bound_ratio"] or 0.0 for c in group)
        lines.append(f"{collective:14s} {levels:8s} {len(group):5d} {failed:6d} {worst:11.3f}  "
                     f"{'FAIL' if failed else 'PASS'}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="device of the checked tensors (default cuda when there is one); "
                             "cpu checks this check itself: both sides are the reference")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks per node of the two-level cases (default 2 when the ranks "
                             "are 4 or more and even, else 1; on a cluster, its GPUs per node)")
    parser.add_argument("--shard", type=int, default=1 << 20,
                        help="elements per rank of the large case (an unaligned 4101 also runs)")
    parser.add_argument("--levels", choices=("1", "2", "both"), default="both",
                        help="the reduce-scatter's levels: 1 (the world as one node), 2 "
                             "(nodes of --ranks-per-node), or both (default)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help=BACKEND_HELP)
    parser.add_argument("--runner", choices=RUNNERS, default="layer",
                        help="where the async calls run: the runner the layer picks for this "
                             "backend and device (default); the one it takes on NCCL, a side "
                             "stream (stream, CUDA only, on any backend); or the one it takes "
                             "on NCCL under CUDA_DEVICE_MAX_CONNECTIONS=1, whose stages are "
                             "issued at the later calls (deferred)")
    parser.add_argument("--json", default=None, help="write every case's result here (rank 0)")
    args = parser.parse_args(argv)
    machine = Machine.here(os.environ)
    device_type = args.device or ("cuda" if machine.cuda_available else "cpu")
    if args.runner == "stream" and (device_type != "cuda" or not machine.cuda_available):
        print("device_collectives: error: --runner stream runs the async calls on a CUDA side "
              "stream; give it --device cuda on a machine with a GPU, or leave --runner out",
              file=sys.stderr)
        return 2
    try:
        backend = choose_backend(args.backend, machine, device_type)
        device = start_world(backend, machine)
    except WorldError as error:
        print(f"device_collectives: error: {error}", file=sys.stderr)
        return 2
    if device is None and device_type == "cuda":  # gloo ranks share the visible GPUs
        torch.cuda.set_device(machine.local_rank % machine.gpu_count)
        device = torch.device("cuda", torch.cuda.current_device())
    elif device is None:
        device = torch.device("cpu")
    try:
        world = dist.get_world_size()
        if args.ranks_per_node is None:
            args.ranks_per_node = 2 if world >= 4 and world % 2 == 0 else 1
        if world % args.ranks_per_node:
            raise SystemExit(f"device_collectives: error: --ranks-per-node {args.ranks_per_node} "
                             f"does not divide {world} ranks")
        try:
            rpns = level_counts(args.levels, world, args.ranks_per_node)
        except ValueError as error:
            raise SystemExit(f"device_collectives: error: {error}") from None
        build_private_groups([list(range(world))])
        for rpn in rpns:  # a collective: here, before the cases
            get_topology(private_group(dist.group.WORLD), rpn)
        # the layer's runner for this backend and device: a side stream on NCCL, a worker
        # thread on gloo (on a private twin of the group)
        kind = runner_kind(dist.group.WORLD, device) if args.runner == "layer" else args.runner
        runner = make_runner(kind, device)
        try:
            cases = run_cases(device, (4101, args.shard), rpns, runner)
            priority = runner_case(runner, device)
            if priority is not None:
                priority["passed"] = passed(priority)
                cases.append(priority)
        finally:
            runner.close()
        everyone: List[Optional[list]] = [None] * world
        dist.all_gather_object(everyone, cases)
    finally:
        forget_subgroups()
        dist.destroy_process_group()
    # A case passes when it passed on every rank; the worst rank's figures are shown.
    merged = []
    for index, case in enumerate(cases):
        per_rank = [rank_cases[index] for rank_cases in everyone]
        worst = max(per_rank, key=lambda c: (not c["passed"], c["bound_ratio"] or 0.0))
        merged.append(dict(worst, passed=all(c["passed"] for c in per_rank)))
    if int(os.environ.get("RANK", "0")) == 0:
        levels = " and ".join("1 level" if rpn == world else f"2 levels ({world // rpn} nodes x {rpn})"
                              for rpn in rpns)
        print(f"device collectives: {world} {backend} ranks, {levels}, checked on {device} "
              f"against the CPU reference and the exact sums (async calls on a {kind} runner)")
        for case in merged:
            print(_describe(case))
        failed = sum(not c["passed"] for c in merged)
        print(summary_table(merged))
        print(f"device collectives: {len(merged) - failed} of {len(merged)} cases hold")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"device": str(device), "backend": backend, "world": world,
                           "cases": merged}, f, indent=1)
    return 0 if all(c["passed"] for c in merged) else 1


if __name__ == "__main__":
    sys.exit(main())
