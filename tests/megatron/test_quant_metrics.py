"""The sampled quantization-error metrics the patch layer logs."""
import pytest
import torch

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
    errors = {k: float(v) for k, v in grad_quantization_errors(grads, preset("sdp4bit")).items()}
    assert torch.equal(torch.get_rng_state(), state)
    # 8-bit intra hop vs 4-bit inter hop: about 16x less error, both clearly non-zero.
    assert 0 < errors["grad_intra"] < errors["grad_inter"] / 8
    assert 0.05 < errors["grad_inter"] < 0.3
    ulq = {k: float(v) for k, v in grad_quantization_errors(grads, preset("zeropp")).items()}
    assert abs(ulq["grad_intra"] - ulq["grad_inter"]) < 1e-9  # 4/4 bits, same quantizer


def test_tiny_buffers_give_no_estimate():
    assert grad_quantization_errors(torch.randn(100), preset("sdp4bit")) == {}


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
