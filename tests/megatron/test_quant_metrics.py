"""The sampled quantization-error metrics the patch layer logs."""
import pytest
import torch

from harness import spawn_ranks
from harness.tiny_gpt import TinyGPTSpec
from megatron_sdp4bit.config import preset
from megatron_sdp4bit.megatron.quant_metrics import (QuantErrorMetrics, gradient_group_shape,
                                                      grad_quantization_errors, relative_error,
                                                      spread_groups)


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


def _group_shape_sampled(rank, world_size):
    """The group shape of one sampled step of a model in several bucket groups, and the
    groups its buffers hold."""
    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit.megatron import patch

    patch.install(preset("sdp4bit", ranks_per_node=1))
    patch.set_metrics_interval(2)
    trainer = TinyGPTTrainer(TinyGPTSpec(dtype="fp32", overlap_grad_reduce=True, bucket_size=4000))
    trainer.train_steps(1)
    unsampled = patch.gradient_group_shape()
    trainer.train_steps(1)
    shape = patch.gradient_group_shape()
    groups = sum(bucket.grad_data.numel() // 128
                 for group in trainer.model.bucket_groups for bucket in group.buckets)
    patch.uninstall()
    return unsampled, shape, groups, trainer.num_buckets


def test_the_group_shape_samples_every_bucket_group_of_a_sampled_step():
    """Not the first bucket group's alone (its elements are the last layers'): the
    sample covers the whole model, and a step that is not sampled reports nothing."""
    for unsampled, shape, groups, bucket_groups in spawn_ranks(_group_shape_sampled, 2, timeout_s=300):
        assert bucket_groups > 1 and unsampled == {}
        assert shape["groups"] == groups, (shape, groups)  # below GROUP_SAMPLE: every group
        assert 1 <= shape["crest_median"] <= shape["crest_p99"] <= shape["crest_max"] <= 128 ** 0.5
        assert 0 < shape["error_tlq"] < 1 and 0 < shape["error_tlq_hs"] < 1


def _group_shape_budget(rank, world_size, bucket_size, budget_groups):
    """How many groups one sampled step sampled, with a budget of ``budget_groups``."""
    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit.megatron import patch, quant_metrics

    quant_metrics.GROUP_SAMPLE = budget_groups * 128
    patch.install(preset("sdp4bit", ranks_per_node=1))
    patch.set_metrics_interval(1)
    trainer = TinyGPTTrainer(TinyGPTSpec(dtype="fp32", overlap_grad_reduce=True,
                                         bucket_size=bucket_size))
    trainer.train_steps(1)
    shape = patch.gradient_group_shape()
    patch.uninstall()
    return shape["groups"], trainer.num_buckets


def test_the_group_shape_sample_is_one_budget_whatever_the_bucket_count():
    """A sampled step's sample is spread over the whole model at one stride: more
    buckets (--overlap-grad-reduce) do not sample more (they did: a budget per buffer,
    ten times the work on ten buckets)."""
    budget = 40
    for bucket_size in (None, 4000):
        for groups, buckets in spawn_ranks(_group_shape_budget, 2, bucket_size, budget,
                                           timeout_s=300):
            assert buckets > 1 or bucket_size is None
            # whole groups at one stride: the budget, give or take a group per buffer
            assert budget - buckets <= groups <= budget + buckets, (groups, buckets, bucket_size)


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


def test_spread_groups_takes_whole_groups_across_the_buffer():
    buffer = torch.arange(10 * 128 + 5, dtype=torch.float32)
    rows = spread_groups(buffer, 128, limit=4 * 128)  # 10 groups, at most 4: every 3rd
    assert rows.shape == (4, 128) and rows[:, 0].tolist() == [0, 3 * 128, 6 * 128, 9 * 128]
    assert spread_groups(buffer, 128, limit=1 << 20).shape == (10, 128)  # the tail is no group
    assert spread_groups(torch.zeros(100), 128).shape[0] == 0
    assert gradient_group_shape(torch.zeros(100), preset("sdp4bit")) == {}


def test_the_rotation_pays_on_heavy_tailed_groups_only():
    """On Gaussian groups TLq and TLq-HS err alike (about 0.166, docs/results.md); on
    groups with an outlier each, TLq errs more and TLq-HS does not, and the crest
    factors say so. The training's RNG is left alone."""
    generator = torch.Generator().manual_seed(0)
    gaussian = torch.randn(1 << 16, generator=generator)
    spiky = gaussian.clone()
    spiky[::128] = 30.0  # about 30 standard deviations: crest about 10.6
    state = torch.get_rng_state()
    metrics = QuantErrorMetrics()
    for step, values in enumerate((gaussian, spiky)):
        metrics.record_group_shape(gradient_group_shape(values, preset("sdp4bit")), step)
        shape = metrics.read_group_shape()
        assert shape["groups"] == values.numel() // 128
        if values is gaussian:
            assert 2.5 < shape["crest_median"] < 3.1 and shape["crest_share_above_8"] == 0
            assert abs(shape["error_tlq"] - shape["error_tlq_hs"]) < 0.01
        else:
            assert shape["crest_median"] > 8 and shape["crest_share_above_8"] == 1
            assert shape["error_tlq"] > 2 * shape["error_tlq_hs"]
    assert torch.equal(torch.get_rng_state(), state)
    assert metrics.read_group_shape() == {}  # read once


def test_a_sampled_steps_buffers_add_up():
    """Two buffers read as one sample: the groups and the squared errors add."""
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(128 * 40, generator=generator), torch.randn(128 * 24, generator=generator) * 5
    config = preset("sdp4bit")
    metrics = QuantErrorMetrics()
    metrics.record_group_shape(gradient_group_shape(a, config), 9)
    metrics.record_group_shape(gradient_group_shape(b, config), 9)
    both = metrics.read_group_shape()
    alone = {name: float(v) for name, v in gradient_group_shape(torch.cat([a, b]), config).items()
             if name != "crest"}
    assert both["groups"] == 64
    # the same sums, up to the rounding draws (another generator offset for b)
    assert both["error_tlq"] == pytest.approx((alone["error2_tlq"] / alone["norm2"]) ** 0.5, rel=0.05)


def test_a_rank_that_never_reads_keeps_one_sampled_step_not_every_one():
    """Megatron-LM's route reads the samples on the last rank only: on a rank that never
    reads, every sampled step used to append its buffers' device tensors for the whole
    run. A later sampled step now replaces what was not read."""
    generator = torch.Generator().manual_seed(2)
    config = preset("sdp4bit")
    metrics = QuantErrorMetrics()
    for step in range(9, 1000, 10):  # a hundred sampled steps, two buffers each, unread
        for numel in (128 * 8, 128 * 4):
            metrics.record_group_shape(
                gradient_group_shape(torch.randn(numel, generator=generator), config), step)
    assert len(metrics._group_shapes) == 2  # the last sampled step's two buffers
    assert metrics.read_group_shape()["groups"] == 12
