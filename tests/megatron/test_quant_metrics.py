"""The sampled quantization-error metrics the patch layer logs."""
import pytest
import torch

from harness import spawn_ranks
from harness.tiny_gpt import TinyGPTSpec
from megatron_sdp4bit.config import preset
from megatron_sdp4bit.megatron.quant_metrics import (QuantErrorMetrics, grad_quantization_errors,
                                                      relative_error)


def test_relative_error_is_a_device_tensor():
    x = torch.tensor([3.0, 4.0])
    assert torch.is_tensor(relative_error(x, x)) and relative_error(x, x).dim() == 0
    assert float(relative_error(x, x)) == 0.0
    assert abs(float(relative_error(torch.zeros(2), x)) - 1.0) < 1e-7
    assert float(relative_error(x, torch.zeros(2))) == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_relative_error_of_non_finite_values_is_nan_not_zero(bad):
    exact = torch.tensor([3.0, bad])
    assert torch.isnan(relative_error(torch.tensor([3.0, 4.0]), exact))
    assert torch.isnan(relative_error(exact, exact))  # even "unchanged" Inf/NaN is no 0 error


def test_grad_errors_follow_the_bits_and_leave_global_rng_alone():
    grads = torch.randn(1 << 15, generator=torch.Generator().manual_seed(0))
    state = torch.get_rng_state()
    both = ("intra", "inter")
    errors = {k: float(v) for k, v in grad_quantization_errors(grads, preset("sdp4bit"), both).items()}
    assert torch.equal(torch.get_rng_state(), state)
    # 8-bit intra hop vs 4-bit inter hop: about 16x less error, both clearly non-zero.
    assert 0 < errors["grad_intra"] < errors["grad_inter"] / 8
    assert 0.05 < errors["grad_inter"] < 0.3
    ulq = {k: float(v) for k, v in grad_quantization_errors(grads, preset("zeropp"), both).items()}
    assert abs(ulq["grad_intra"] - ulq["grad_inter"]) < 1e-9  # 4/4 bits, same quantizer


def test_tiny_buffers_give_no_estimate():
    assert grad_quantization_errors(torch.randn(100), preset("sdp4bit"), ("intra", "inter")) == {}


def test_only_the_hops_asked_for_are_estimated():
    grads = torch.randn(1 << 12, generator=torch.Generator().manual_seed(0))
    config = preset("sdp4bit")
    assert set(grad_quantization_errors(grads, config, ("intra",))) == {"grad_intra"}
    assert set(grad_quantization_errors(grads, config, ("inter",))) == {"grad_inter"}
    assert grad_quantization_errors(grads, config, ()) == {}


def _errors_sampled(rank, world_size, layouts):
    """The error names the layer samples in 2 steps, per ranks-per-node layout."""
    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit import comm
    from megatron_sdp4bit.megatron import patch

    sampled = {}
    for ranks_per_node in layouts:
        patch.uninstall()
        comm.reset_generators()
        patch.install(preset("sdp4bit", ranks_per_node=ranks_per_node))
        patch.set_metrics_interval(1)
        TinyGPTTrainer(TinyGPTSpec(dtype="bf16")).train_steps(2)
        sampled[ranks_per_node] = sorted(patch.quantization_errors())
        patch.uninstall()
    return sampled


def test_the_layer_reports_the_errors_of_the_hops_that_ran():
    """2 ranks on one node run the 8-bit intra-node hop only; one rank per node, the 4-bit
    inter-node hop only. Before, both reported both hops' errors (issue 28, item 11)."""
    for sampled in spawn_ranks(_errors_sampled, 2, (2, 1), timeout_s=300):
        assert sampled == {2: ["grad_intra", "weight"], 1: ["grad_inter", "weight"]}, sampled


def test_sampling_happens_on_the_last_step_of_each_window_only():
    metrics = QuantErrorMetrics()
    assert not any(metrics.sample_now(i) for i in range(10))  # off by default
    metrics.set_interval(4)
    assert [i for i in range(12) if metrics.sample_now(i)] == [3, 7, 11]
    metrics.record({"weight": torch.tensor(0.25)})
    assert metrics.read() == {"weight": 0.25}
    assert metrics.read() == {}  # read once: a window without a sample reports none
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="metrics interval"):
            metrics.set_interval(bad)
