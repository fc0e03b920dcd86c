"""megatron_lm/weight_readers.py: Megatron-LM's --log-params-norm reads the weights right
after the optimizer step, while the prefetched weight gathers may still write them; the
wrapped norm waits for the layer's collectives first where it reads what they write, and
says so once. Megatron-LM's
own loop runs it in tests/megatron_lm/test_megatron_training_loop.py (--log-params-norm)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.megatron_lm import weight_readers
from megatron_sdp4bit.patching import Patches


def _sites(events, bf16=False):
    def calc_params_l2_norm(model, force_create_fp32_copy=False):
        events.append("norm read the weights")
        return 1.5

    training = SimpleNamespace(calc_params_l2_norm=calc_params_l2_norm)
    return SimpleNamespace(training=training, params_norm="calc_params_l2_norm",
                           get_args=lambda: SimpleNamespace(bf16=bf16)), calc_params_l2_norm


def _chunk(*main_params: bool):
    """A model chunk whose parameters carry a ``main_param`` or not."""
    params = []
    for has_main in main_params:
        param = SimpleNamespace()
        if has_main:
            param.main_param = None  # a shard on another rank: megatron skips it
        params.append(param)
    return SimpleNamespace(parameters=lambda: iter(params))


def test_the_params_norm_waits_for_the_layers_collectives_first(monkeypatch, caplog):
    events = []
    sites, original = _sites(events)
    monkeypatch.setattr(patch, "is_installed", lambda: True)
    monkeypatch.setattr(patch, "drain", lambda: events.append("drained"))
    patches = Patches("test")
    weight_readers.install_weight_readers(sites, patches)
    with caplog.at_level(logging.INFO, logger=weight_readers.__name__):
        assert sites.training.calc_params_l2_norm([_chunk(True)]) == 1.5  # fp32: param.data
        assert sites.training.calc_params_l2_norm([_chunk(True)]) == 1.5
    assert events == ["drained", "norm read the weights"] * 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "--log-params-norm" in lines[0]
    patches.restore()
    assert sites.training.calc_params_l2_norm is original


def test_without_the_layer_the_norm_is_megatrons_own(monkeypatch):
    events = []
    sites, _ = _sites(events)
    monkeypatch.setattr(patch, "is_installed", lambda: False)
    monkeypatch.setattr(patch, "drain", lambda: events.append("drained"))
    weight_readers.install_weight_readers(sites, Patches("test"))
    sites.training.calc_params_l2_norm([_chunk(False)])
    assert events == ["norm read the weights"]


def test_a_bf16_norm_of_the_fp32_main_params_does_not_wait(monkeypatch, caplog):
    """Megatron-LM computes the norm on every iteration; in bf16 runs it reads each
    parameter's fp32 main_param (which the gathers do not write) where every parameter has
    one: waiting there would end the gathers' overlap on every step for nothing."""
    events = []
    sites, _ = _sites(events, bf16=True)
    monkeypatch.setattr(patch, "is_installed", lambda: True)
    monkeypatch.setattr(patch, "drain", lambda: events.append("drained"))
    weight_readers.install_weight_readers(sites, Patches("test"))
    norm = sites.training.calc_params_l2_norm
    with caplog.at_level(logging.INFO, logger=weight_readers.__name__):
        norm([_chunk(True, True), _chunk(True)])
        assert events == ["norm read the weights"] and not caplog.records
        norm([_chunk(True), _chunk(True, False)])  # one bf16 param without: param.data.float()
        assert events[-2:] == ["drained", "norm read the weights"]
        norm([_chunk(True)], force_create_fp32_copy=True)  # a copy of param.data
        assert events[-2:] == ["drained", "norm read the weights"]
    assert len(caplog.records) == 1
