"""What overlap hides of the data-parallel collectives, per direction (``timing.py`` prices
the rest of the step).

**Overlap** (``none``, ``grads``, ``full``): ``none`` adds everything.
``grads`` hides bucket i's reduce-scatter under the backward pass of the
buckets after it (Megatron's ``--overlap-grad-reduce``), backward = 2/3 of
one micro-batch's compute: megatron reduces the gradients in the last
micro-batch's backward pass only. ``full`` also hides the all-gather under the
next forward pass (1/3 of it; ``--overlap-param-gather``): megatron gathers the
weights in the first micro-batch's forward pass. Each is a queue, bucket by bucket
(``chain_reduce_scatter_exposed``, ``chain_gather_exposed``): bucket i's share of the
elements is its share of the chain and of the pass, the backward pass makes
the buckets ready in megatron's order and the forward pass needs them in the
reverse one. With B equal buckets the exposed time is
``max(comm / B, comm - window x (B - 1) / B)``; with tied embeddings the
bucket that holds them (reduced last, gathered first) is often the largest,
and its share is what no schedule hides. (Its compute is not where its share
puts it: the tied output layer runs first in the backward pass and last in
the forward pass, so the other buckets are ready later and needed earlier than
their shares say; with a large embedding share the hiding of the other buckets
is optimistic.) That is this
project's schedule (``comm/runner.py``): every stage of bucket i's collective
is issued when megatron starts it, on a side stream or a worker thread that
runs the buckets' collectives one after another, so it hides behind the
backward (forward) work of the buckets after (before) it, all but the last
bucket's reduce-scatter and the first bucket's gather, unless the collectives
outrun that work (then the queue grows and the excess is exposed). The runner runs each bucket's kernels
and transfers one after the other, so ``comm`` there is the chain: transfers,
latency and the direction's kernels. (The thread runner also runs bucket
i + 1's first quantization while bucket i's last hop is on the wire, one
hop per bucket: left out, so the modelled chain is slightly long; measured against
the CPU study in docs/performance.md, "Overlap".) Not modelled: the kernels' share of the
device beside the backward pass (on a GPU they may take SMs the backward
needs; on the CPU emulation they take its cores).

Under one hardware queue (``runner="deferred"``, ``CUDA_DEVICE_MAX_CONNECTIONS=1``) the
layer issues each stage at megatron's next call (``comm/deferring_runner.py``), a bucket of
up to ``ONE_QUEUE_WHOLE_BUCKET_ELEMENTS`` in one chunk: each hop hides behind one
bucket's pass and no more, a wait for a hop still in flight stops the pass, the gathers
start one bucket ahead, and the kernels add to the step
(``one_queue.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from megatron_sdp4bit.estimate import calls, one_queue, volume
from megatron_sdp4bit.estimate.network import Network


@dataclass(frozen=True)
class Traffic:
    """One variant's collectives as the overlap needs them: each hop's links, each
    direction's seconds (bandwidth and latency) and latency, the kernels (op -> seconds)."""

    grad_phases: List[volume.Links]
    weight_phases: List[volume.Links]
    grad_s: float
    weight_s: float
    grad_latency_s: float
    weight_latency_s: float
    kernel_ops: Dict[str, float]


def exposed(workload, config, kernels, buckets: Dict[int, List[int]], layouts, network: Network,
            microbatch_compute_s: float, traffic: Traffic) -> Tuple[float, float, float]:
    """(reduce-scatter seconds, gather seconds, kernel seconds) the step waits for, with
    ``workload.overlap`` on ``workload.runner``; ``microbatch_compute_s``: one micro-batch's
    compute, whose passes are the windows."""
    t = traffic
    shares = _bucket_shares(buckets)
    backward, forward = microbatch_compute_s * 2 / 3, microbatch_compute_s / 3
    # An overlapped direction's kernels run in the runner's chain with its transfers
    # (one after the other, bucket after bucket): the chain hides as a whole. Where the
    # kernels share the compute's cores (a CPU), they cost that time anyway: they stay
    # in the step, as part of the pass they run beside, and the chain is the transfers.
    grad_kernels = sum(s for op, s in t.kernel_ops.items() if op.startswith("grad_"))
    weight_kernels = sum(t.kernel_ops.values()) - grad_kernels
    kernel_s = sum(t.kernel_ops.values())
    shared = kernels.shares_compute
    grad_exposed, weight_exposed = t.grad_s, t.weight_s
    if workload.overlap == "none":
        return grad_exposed, weight_exposed, kernel_s
    # On the runner for one hardware queue the quantized collectives' kernels stay in the
    # step (``one_queue.py``); megatron's exact ones run as on the stream runner.
    deferred = workload.runner == "deferred"
    if deferred:
        chunks, slices = _one_queue_splits(buckets, layouts, config, workload.implementation)
    if deferred and config.quantize_grads:
        grad_exposed = one_queue.reduce_scatter_exposed(
            _hop_seconds(t.grad_phases, t.grad_latency_s, network), backward, shares, chunks)
    elif not (deferred and workload.exact_reduce_scatter == "alltoall"):
        # (the layer's exact all-to-all waits inside its call on one queue: all exposed)
        grad_exposed = (chain_reduce_scatter_exposed(t.grad_s, backward + grad_kernels, shares)
                        if shared else
                        chain_reduce_scatter_exposed(t.grad_s + grad_kernels, backward, shares))
        kernel_s -= 0 if shared else grad_kernels
    if workload.overlap == "full" and t.weight_phases:
        if deferred and config.quantize_weights:
            weight_exposed = one_queue.gather_exposed(
                _hop_seconds(t.weight_phases, t.weight_latency_s, network), forward, shares,
                slices)
        else:
            weight_exposed = (chain_gather_exposed(t.weight_s, forward + weight_kernels, shares)
                              if shared else
                              chain_gather_exposed(t.weight_s + weight_kernels, forward, shares))
            kernel_s -= 0 if shared else weight_kernels
    return grad_exposed, weight_exposed, kernel_s


def _bucketed_stage(buckets: Dict[int, List[int]]) -> int:
    """The stage with the most buckets (megatron buckets stage 0 only): its buckets set
    the overlap's pace."""
    return max(buckets, key=lambda stage: len(buckets[stage]))


def _bucket_shares(buckets: Dict[int, List[int]]) -> List[float]:
    """Each bucket's share of the elements, in megatron's bucket order (the first is
    reduced first), of ``_bucketed_stage``."""
    numels = buckets[_bucketed_stage(buckets)]
    total = sum(numels)
    return [n / total for n in numels]


def _one_queue_splits(buckets, layouts, config, impl) -> Tuple[List[int], List[int]]:
    """Each bucket's reduce-scatter chunks and gather slices on ``_bucketed_stage``."""
    stage = _bucketed_stage(buckets)
    layout = dict(layouts)[stage]
    shards = [n // layout.dp_size for n in buckets[stage]]
    return ([len(volume.grad_chunks(s, layout, config, impl)) for s in shards],
            [calls.weight_slices(s, layout, config, impl) for s in shards])


def chain_reduce_scatter_exposed(comm: float, backward: float, shares: List[float]) -> float:
    """What of a chain of ``comm`` seconds outlasts the ``backward`` pass: bucket i is
    ready once the backward pass has done its share of the elements, and the chain runs
    the buckets one after another, each taking its share of ``comm``. The last bucket's
    share is never hidden; a chain that outruns the backward pass exposes its excess."""
    ready = done = 0.0
    for share in shares:
        ready += backward * share
        done = max(done, ready) + comm * share
    return done - backward


def chain_gather_exposed(comm: float, forward: float, shares: List[float]) -> float:
    """What a chain of ``comm`` seconds of gathers, all issued before the ``forward``
    pass, adds to it: the forward pass runs the buckets in the reverse order, each once
    its gather is done. The first bucket's gather is never hidden."""
    gathered = computed = 0.0
    for share in reversed(shares):
        gathered += comm * share
        computed = max(computed, gathered) + forward * share
    return computed - forward


def _hop_seconds(phases: List[volume.Links], latency_s: float, network: Network) -> List[float]:
    """Seconds of each hop (phase) of a direction over all buckets, its calls' latency split
    evenly between the hops."""
    return [network.phase_seconds(links) + latency_s / len(phases) for links in phases]
