"""Megatron features the layer does not handle are refused in one line, at set-up.

CUDA graphs (the model config DDP is built with), the optimizer's
``overlap_param_gather_with_optimizer_step`` (checked at the first optimizer step,
before any weight is gathered), and, for gloo on GPUs or the exact reduce-scatter as
an all-to-all, a DDP the layer's own exact collectives cannot serve. The checks read plain config objects, so they are tested
on stand-ins with the same fields; the DDP-construction hook that calls them runs
in every multi-rank test.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_sdp4bit.megatron.adapters import v0_19
from megatron_sdp4bit.megatron.checks import (
    check_alltoall_ddp_config,
    check_host_staged_ddp,
    check_model_config,
    check_optimizer_config,
)


@pytest.mark.parametrize("fields", [dict(cuda_graph_impl="local"),
                                    dict(cuda_graph_impl="transformer_engine"),
                                    dict(cuda_graph_impl="none", enable_cuda_graph=True),
                                    dict(cuda_graph_impl="none", external_cuda_graph=True)])
def test_cuda_graphs_are_refused(fields):
    with pytest.raises(RuntimeError, match="does not support CUDA graphs") as error:
        check_model_config(SimpleNamespace(**fields))
    assert "\n" not in str(error.value)


def test_no_cuda_graphs_pass():
    check_model_config(SimpleNamespace(cuda_graph_impl="none", enable_cuda_graph=False,
                                       external_cuda_graph=False))
    check_model_config(SimpleNamespace())  # a release without the fields


def test_param_gather_inside_the_optimizer_step_is_refused():
    with pytest.raises(RuntimeError, match="--overlap-param-gather-with-optimizer-step"):
        check_optimizer_config(SimpleNamespace(overlap_param_gather_with_optimizer_step=True))
    check_optimizer_config(SimpleNamespace(overlap_param_gather_with_optimizer_step=False))
    check_optimizer_config(None)


def test_gloo_on_gpus_needs_the_distributed_optimizer():
    with pytest.raises(RuntimeError, match="--use-distributed-optimizer"):
        check_host_staged_ddp(SimpleNamespace(use_distributed_optimizer=False,
                                              num_distributed_optimizer_instances=1))
    with pytest.raises(RuntimeError, match="one distributed optimizer instance"):
        check_host_staged_ddp(SimpleNamespace(use_distributed_optimizer=True,
                                              num_distributed_optimizer_instances=2))
    check_host_staged_ddp(SimpleNamespace(use_distributed_optimizer=True,
                                          num_distributed_optimizer_instances=1))


def test_the_exact_alltoall_needs_the_distributed_optimizer_and_supported_features():
    adapter = v0_19.Adapter()
    plain = SimpleNamespace(use_distributed_optimizer=False, num_distributed_optimizer_instances=1)
    with pytest.raises(RuntimeError, match="--sdp4bit-exact-reduce-scatter alltoall .*--use-distributed-optimizer"):
        check_alltoall_ddp_config(adapter, plain)
    two = SimpleNamespace(use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    with pytest.raises(RuntimeError, match="does not support num_distributed_optimizer_instances > 1"):
        check_alltoall_ddp_config(adapter, two)
    check_alltoall_ddp_config(adapter, SimpleNamespace(use_distributed_optimizer=True,
                                                       num_distributed_optimizer_instances=1))
