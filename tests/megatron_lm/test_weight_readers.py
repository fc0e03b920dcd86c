"""megatron_lm/weight_readers.py: Megatron-LM's --log-params-norm reads the weights right
after the optimizer step, while the prefetched weight gathers may still write them; the
wrapped norm waits for the layer's collectives first, and says so once. Megatron-LM's
own loop runs it in tests/megatron_lm/test_megatron_training_loop.py (--log-params-norm)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.megatron_lm import weight_readers
from megatron_sdp4bit.patching import Patches


def _sites(events):
    def calc_params_l2_norm(model):
        events.append("norm read the weights")
        return 1.5

    training = SimpleNamespace(calc_params_l2_norm=calc_params_l2_norm)
    return SimpleNamespace(training=training, params_norm="calc_params_l2_norm"), calc_params_l2_norm


def test_the_params_norm_waits_for_the_layers_collectives_first(monkeypatch, caplog):
    events = []
    sites, original = _sites(events)
    monkeypatch.setattr(patch, "is_installed", lambda: True)
    monkeypatch.setattr(patch, "drain", lambda: events.append("drained"))
    patches = Patches("test")
    weight_readers.install_weight_readers(sites, patches)
    with caplog.at_level(logging.INFO, logger=weight_readers.__name__):
        assert sites.training.calc_params_l2_norm("model") == 1.5
        assert sites.training.calc_params_l2_norm("model") == 1.5
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
    sites.training.calc_params_l2_norm("model")
    assert events == ["norm read the weights"]
