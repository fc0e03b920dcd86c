"""Under one hardware queue the layer plans its kernels and memory in the runner's chunks.

The deferring runner (``comm/deferring_runner.py``) takes a bucket of up to 64 M
elements in one chunk and one slice. The collectives follow the runner they are handed
(tests/comm/test_comm_one_queue.py); what the layer computes ahead of them must follow
it too, or the first step compiles kernels (``_warm_up_kernels``) and the memory line
counts other buffers (``megatron/memory.py``). Checked without ranks or tensors of that
size: megatron's buckets here are stand-ins that only have sizes, one 40 M-element bucket
at DP 8 on one node (whole on the runner; 5 chunks of ``MAX_CHUNK_ELEMENTS`` elsewhere).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_sdp4bit.comm.deferring_runner import DeferringRunner
from megatron_sdp4bit.comm.kernel_specs import all_gather_specs, reduce_scatter_specs
from megatron_sdp4bit.comm.layout import MAX_CHUNK_ELEMENTS
from megatron_sdp4bit.comm.memory_plan import layer_memory
from megatron_sdp4bit.comm.runner import InlineRunner
from megatron_sdp4bit.config import preset
from megatron_sdp4bit.megatron import layer as layer_module
from megatron_sdp4bit.megatron import memory as memory_module
from megatron_sdp4bit.megatron.state import LayerState

DP = 8
BUCKET = -(-40_000_000 // (DP * 128)) * DP * 128  # megatron's default, padded to lcm(DP, 128)
CONFIG = preset("sdp4bit", ranks_per_node=DP)


def _stand_in(numel: int, dtype: torch.dtype):
    """What the layer reads of megatron's bucket tensors: size, type, place, address."""
    return SimpleNamespace(numel=lambda: numel, dtype=dtype, device=torch.device("cpu"),
                           data_ptr=lambda: 0, element_size=lambda: dtype.itemsize)


def _layer(runner, monkeypatch):
    """A layer on ``runner`` whose one DDP has one bucket group of one 40 M bucket."""
    bucket = SimpleNamespace(grads=_stand_in(BUCKET, torch.float32),
                             params=_stand_in(BUCKET, torch.bfloat16))
    adapter = SimpleNamespace(
        ddp_bucket_groups=lambda ddp: ["group"], expert_bucket_groups=lambda ddp: [],
        collective_group=lambda bucket_group: ("dp", DP, 0),
        ddp_config=lambda bucket_group: SimpleNamespace(average_in_collective=True),
        group_buckets=lambda bucket_group: [bucket],
        bucket_grad_data=lambda b: b.grads, bucket_param_data=lambda b: b.params,
        sub_optimizers=lambda optimizer: ["optimizer"],
        optimizer_group=lambda sub: ("dp", DP), optimizer_process_group=lambda sub: "dp",
        buffer_buckets=lambda sub: [(None, bucket)])
    one_node = SimpleNamespace(levels=[SimpleNamespace(name="intra", size=DP)],
                               send_order_index=lambda device: None)
    monkeypatch.setattr(layer_module.comm, "get_topology", lambda group, rpn: one_node)
    monkeypatch.setattr(memory_module, "get_topology", lambda group, rpn: one_node)
    state = LayerState(config=CONFIG)
    state.runner = runner
    return SimpleNamespace(state=state, adapter=adapter)


def _warmed_up(layer, monkeypatch) -> list:
    compiled = []
    monkeypatch.setattr(layer_module.quant, "warm_up",
                        lambda specs, device: compiled.extend(specs) or 0.0)
    layer_module._warm_up_kernels(layer, "ddp")
    return compiled


def _expected_specs(whole: bool) -> list:
    specs = (reduce_scatter_specs(BUCKET // DP, torch.float32, [("intra", DP)], CONFIG,
                                  average=True, ordered=False, whole=whole)
             + all_gather_specs(BUCKET // DP, DP, torch.bfloat16, CONFIG, whole=whole))
    return list(dict.fromkeys(specs))


def test_the_warm_up_compiles_the_runners_chunks(monkeypatch):
    deferred = _warmed_up(_layer(DeferringRunner(torch.device("cpu")), monkeypatch), monkeypatch)
    elsewhere = _warmed_up(_layer(InlineRunner(), monkeypatch), monkeypatch)
    assert deferred == _expected_specs(whole=True)
    assert elsewhere == _expected_specs(whole=False)
    # one chunk's kernels against five chunks' (the whole bucket is one variant per kernel)
    assert BUCKET > 4 * MAX_CHUNK_ELEMENTS and set(deferred) != set(elsewhere)


def test_the_memory_line_counts_the_runners_buffers(monkeypatch):
    for runner, whole in ((DeferringRunner(torch.device("cpu")), 1 << 26), (InlineRunner(), None)):
        layer = _layer(runner, monkeypatch)
        expected = layer_memory([BUCKET], DP, CONFIG, params=BUCKET, node_members=DP,
                                fp32_params=False, whole_bucket_elements=whole)
        assert memory_module.optimizer_memory(layer, "optimizer", BUCKET) == expected
    assert expected.buffer_bytes < layer_memory(
        [BUCKET], DP, CONFIG, params=BUCKET, node_members=DP, fp32_params=False,
        whole_bucket_elements=1 << 26).buffer_bytes  # the whole bucket's buffers are larger
