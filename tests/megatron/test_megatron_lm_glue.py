"""The Megatron-LM glue without a Megatron-LM checkout: a stand-in parse_args with
Megatron-LM's signature (parser built inside, extra_args_provider applied)."""
import argparse
import sys

import pytest

from megatron_sdp4bit import megatron_lm
from megatron_sdp4bit.megatron import patch


def fake_megatron_parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--num-layers", type=int, default=1)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()


@pytest.fixture(autouse=True)
def no_layer_left_installed():
    yield
    patch.uninstall()


def test_wrapped_parse_args_knows_the_flags_and_installs(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "3", "--sdp4bit",
                                      "--sdp4bit-weight-mode", "direct"])
    wrapped = megatron_lm.wrap_parse_args(fake_megatron_parse_args)
    assert megatron_lm.wrap_parse_args(wrapped) is wrapped  # wrapping twice is a no-op
    args = wrapped()
    assert args.num_layers == 3 and args.sdp4bit and args.sdp4bit_weight_mode == "direct"
    assert patch.is_installed() and patch.current_config().weight_mode == "direct"


def test_without_sdp4bit_flags_nothing_is_installed(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2"])
    megatron_lm.wrap_parse_args(fake_megatron_parse_args)()
    assert not patch.is_installed()


def test_extend_args_provider_keeps_the_scripts_own_provider(monkeypatch):
    def own(parser):
        parser.add_argument("--own-flag", type=int, default=7)
        return parser

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--own-flag", "9", "--sdp4bit-preset", "zeropp"])
    args = fake_megatron_parse_args(megatron_lm.extend_args_provider(own))
    assert args.own_flag == 9 and args.sdp4bit_preset == "zeropp"


@pytest.mark.parametrize("argv, message", [
    (["--sdp4bit-weight-group-size", "3"], "error: --sdp4bit-weight-group-size 3: weight_group_size=3 must be "
                                           "a positive multiple of 2"),
    (["--sdp4bit-hadamard-block", "48"], "error: --sdp4bit-hadamard-block 48: "),
    (["--sdp4bit-check-interval", "-1"], "error: --sdp4bit-check-interval -1: "),
])
def test_a_bad_sdp4bit_value_through_megatron_lm_is_one_line_and_exit_2(monkeypatch, capsys, argv, message):
    """The launcher and the patch route call the wrapped parse_args: the same refusal as
    the driver's, before Megatron-LM initializes anything, and nothing installed."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--sdp4bit", *argv])
    with pytest.raises(SystemExit) as exit_info:
        megatron_lm.wrap_parse_args(fake_megatron_parse_args)()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not patch.is_installed()
