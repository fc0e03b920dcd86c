"""Megatron features the layer does not handle are refused in one line, at set-up.

CUDA graphs (the model config DDP is built with), the optimizer's
``overlap_param_gather_with_optimizer_step`` (checked at the first optimizer step,
before any weight is gathered), and, for gloo on GPUs or the exact reduce-scatter as
an all-to-all, a DDP the layer's own exact collectives cannot serve. The checks read plain config objects, so they are tested
on stand-ins with the same fields; the DDP-construction hook that calls them runs
in every multi-rank test. One 2-rank test counts the refusals the steps run (none per
step) and shows a second ``install()`` that quantizes a model built without it refused.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_sdp4bit.megatron.adapters import v0_19
from megatron_sdp4bit.megatron.config_refusals import (
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


def test_one_rule_set_for_a_ddp_config():
    """``check_ddp_for`` runs the refusals the config makes apply, and no others."""
    from megatron_sdp4bit.config import preset
    from megatron_sdp4bit.megatron.config_refusals import check_ddp_for

    adapter = v0_19.Adapter()
    plain = SimpleNamespace(use_distributed_optimizer=False, num_distributed_optimizer_instances=1)
    check_ddp_for(preset("baseline"), adapter, plain)  # megatron's own all-reduce: nothing to refuse
    with pytest.raises(RuntimeError, match="enable it with --use-distributed-optimizer"):
        check_ddp_for(preset("sdp4bit"), adapter, plain)
    with pytest.raises(RuntimeError, match="--sdp4bit-exact-reduce-scatter alltoall"):
        check_ddp_for(preset("baseline", exact_reduce_scatter="alltoall"), adapter, plain)


def _refusals_in_steps(rank, world_size):
    """How often the steps ran the refusals: a model built under the config is checked at
    DDP construction (its optimizer at its first step), not per step; a plain DDP built
    under the baseline, then quantized by a second install(), is refused at its first
    step."""
    from harness.tiny_gpt import TinyGPTSpec, TinyGPTTrainer
    from megatron_sdp4bit.config import preset
    from megatron_sdp4bit.megatron import patch, state
    from megatron_sdp4bit.patching import Patches

    calls = {"ddp": 0, "optimizer": 0}

    def counted(kind, check):
        def counting(*args):
            calls[kind] += 1
            return check(*args)
        return counting

    sdp = preset("sdp4bit", ranks_per_node=1)
    with Patches() as patches:  # the names the step path (LayerState.refuse_once) calls
        patches.set(state, "check_ddp_for", counted("ddp", state.check_ddp_for))
        patches.set(state, "check_optimizer_config", counted("optimizer", state.check_optimizer_config))
        patch.uninstall()
        patch.install(sdp)
        try:
            trainer = TinyGPTTrainer(TinyGPTSpec())
            built = dict(calls)
            trainer.train_steps(1)
            first = dict(calls)
            trainer.train_steps(3)
            later = dict(calls)
        finally:
            patch.uninstall()
        patch.install(preset("baseline", ranks_per_node=1))
        try:
            plain = TinyGPTTrainer(TinyGPTSpec(use_distributed_optimizer=False))
            patch.install(sdp)  # replaces the config of the installed layer
            try:
                plain.train_steps(1)
                refused = None
            except RuntimeError as error:
                refused = str(error)
        finally:
            patch.uninstall()
    return built, first, later, refused


def test_the_steps_do_not_rerun_the_refusals_but_a_reinstall_is_refused():
    from harness import spawn_ranks

    for built, first, later, refused in spawn_ranks(_refusals_in_steps, 2, timeout_s=120):
        assert built == {"ddp": 0, "optimizer": 0}  # DDP's were marked when it was built
        assert first == {"ddp": 1, "optimizer": 1}  # the optimizer's, at its first step
        assert later == first  # nothing per step
        assert refused is not None and "--use-distributed-optimizer" in refused
