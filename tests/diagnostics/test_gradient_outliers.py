"""diagnostics/gradient_outliers.py: the arithmetic of the crest factors, the kinds, the
4-bit errors, on hand-made tensors (the training run itself is the driver's, tested
under tests/training)."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_sdp4bit.diagnostics import gradient_outliers as go


@pytest.mark.parametrize("name, kind", [
    ("module.embedding.word_embeddings.weight", "embedding"),
    ("module.embedding.position_embeddings.weight", "embedding"),
    ("module.decoder.layers.0.self_attention.linear_qkv.weight", "qkv"),
    ("module.decoder.layers.0.self_attention.linear_qkv.bias", "qkv"),
    ("module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "norm"),
    ("module.decoder.layers.0.input_layernorm.weight", "norm"),
    ("module.decoder.layers.3.self_attention.linear_proj.weight", "attention output"),
    ("module.decoder.layers.1.pre_mlp_layernorm.bias", "norm"),
    ("module.decoder.layers.1.mlp.linear_fc1.weight", "mlp fc1"),
    ("module.decoder.layers.1.mlp.linear_fc2.bias", "mlp fc2"),
    ("module.decoder.final_layernorm.weight", "norm"),
    ("module.output_layer.weight", "output layer"),
    ("module.something_new.weight", "other"),
])
def test_parameter_kinds_from_megatron_names(name, kind):
    assert go.parameter_kind(name) == kind


def test_crest_factor_of_flat_spiky_and_zero_groups():
    groups = torch.zeros(3, 128)
    groups[0] = 0.5  # flat: max = rms
    groups[1, 7] = -3.0  # one value: max / rms = sqrt(128)
    crests = go.crest_factors(groups)
    assert crests[0].item() == pytest.approx(1.0)
    assert crests[1].item() == pytest.approx(math.sqrt(128))
    assert math.isnan(crests[2].item())  # all zero: no scale, left out of the summary
    summary = go.crest_summary(crests, threshold=8.0)
    assert summary["groups"] == 2 and summary["zero_groups"] == 1
    assert summary["share_above"] == 0.5 and summary["max"] == pytest.approx(math.sqrt(128))
    assert summary["median"] == pytest.approx(1.0)  # torch's lower median of two


def test_a_group_takes_the_kind_most_of_its_elements_have():
    pad = go.PADDING
    labels = torch.tensor([0] * 3 + [2] * 5 + [pad] * 8 + [4] * 2 + [pad] * 3, dtype=torch.int8)
    kinds = go.group_kinds(labels, 8)  # 21 elements: the last group zero-padded
    assert kinds.tolist() == [2, pad, 4]  # padding never outvotes a parameter


def test_the_rotation_lowers_the_error_of_a_group_with_an_outlier():
    generator = torch.Generator().manual_seed(0)
    flat = torch.randn(128 * 64, generator=generator)
    spiky = flat.clone()
    spiky[::128] = 100.0  # one outlier per group, ~100 standard deviations
    fmt = go.GroupFormat(rounding="stochastic")  # the layer's: nearest rounding zeroes the
    # small values beside an outlier, an error the outlier's own norm dwarfs
    labels = torch.full((flat.numel(),), go.KINDS.index("mlp fc1"), dtype=torch.int8)
    smooth = go.measure_buffer(flat, labels, fmt, threshold=8.0, generator=generator)["mlp fc1"]
    spikes = go.measure_buffer(spiky, labels, fmt, threshold=8.0, generator=generator)["mlp fc1"]
    assert spikes["crest"]["share_above"] == 1.0 and smooth["crest"]["share_above"] == 0.0
    assert spikes["crest_rotated"]["max"] < 8.0  # spread over its block of 32
    assert spikes["error_tlq_hs"] < 0.5 * spikes["error_tlq"]
    # on Gaussian groups the rotation changes little (the make-train gradients' case)
    assert smooth["error_tlq_hs"] == pytest.approx(smooth["error_tlq"], rel=0.25)


def test_bucket_labels_place_parameters_by_their_main_grad_view():
    buffer = torch.zeros(300)

    class Param:
        def __init__(self, start, numel):
            self.main_grad = buffer[start:start + numel]

    bucket = buffer[100:300]
    named = [("decoder.layers.0.mlp.linear_fc2.weight", Param(110, 50)),
             ("embedding.word_embeddings.weight", Param(0, 90)),  # another bucket's
             ("decoder.final_layernorm.weight", Param(250, 10))]
    labels = go.bucket_labels(bucket, named)
    assert (labels[10:60] == go.KINDS.index("mlp fc2")).all()
    assert (labels[150:160] == go.KINDS.index("norm")).all()
    assert int((labels != go.PADDING).sum()) == 60


def test_the_figure_reads_one_kind_over_the_sampled_iterations():
    from megatron_sdp4bit.diagnostics.gradient_outliers_figure import series

    samples = [{"iteration": 1, "kinds": {"qkv": {"crest": {"p99": 4.0}, "error_tlq": 0.2}}},
               {"iteration": 5, "kinds": {"norm": {"crest": {"groups": 0}}}},
               {"iteration": 9, "kinds": {"qkv": {"crest": {"p99": 6.0}, "error_tlq": 0.3}}}]
    assert series(samples, "qkv", "crest", "p99") == ((1, 9), (4.0, 6.0))
    assert series(samples, "norm", "crest", "p99") == ((), ())  # all-zero groups: no figure
    assert series(samples, "qkv", "error_tlq") == ((1, 9), (0.2, 0.3))
