"""The Megatron-LM glue without a Megatron-LM checkout: a stand-in parse_args with
Megatron-LM's signature (parser built inside, extra_args_provider applied) and the few
Megatron-LM flags the refusals read, under Megatron-LM's names."""
import argparse
import sys

import pytest

from megatron_sdp4bit import megatron_lm
from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.megatron.installed import INSTALLED
from megatron_sdp4bit.megatron_lm import refusals, routes


def fake_megatron_parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--cuda-graph-impl", default="none")
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--ckpt-format", default="torch_dist")
    parser.add_argument("--use-torch-fsdp2", action="store_true")
    parser.add_argument("--use-megatron-fsdp", action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()


@pytest.fixture(autouse=True)
def no_layer_left_installed():
    yield
    patch.uninstall()
    routes.remove_megatron_lm_hooks()


def test_wrapped_parse_args_knows_the_flags_and_installs(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "3", "--sdp4bit",
                                      "--sdp4bit-weight-mode", "direct", "--use-distributed-optimizer"])
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
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--sdp4bit", "--use-distributed-optimizer", *argv])
    with pytest.raises(SystemExit) as exit_info:
        megatron_lm.wrap_parse_args(fake_megatron_parse_args)()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not patch.is_installed()


def test_routes_combined_add_the_flags_once_and_install_once(monkeypatch):
    """A patched tree run through the launcher: the launcher's wrapped parse_args gets the
    patch's extend_args_provider(...) and then the patch calls install_from_args too
    (before: argparse.ArgumentError "conflicting option string: --sdp4bit")."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--sdp4bit", "--use-distributed-optimizer",
                                      "--sdp4bit-grad-mode", "ulq"])
    launcher_wrapped = megatron_lm.wrap_parse_args(fake_megatron_parse_args)
    args = launcher_wrapped(megatron_lm.extend_args_provider(None))  # the patch's provider
    layer = INSTALLED.layer
    assert layer is not None and patch.current_config().grad_mode == "ulq"
    assert megatron_lm.install_from_args(args) == patch.current_config()  # the patch's own line
    assert INSTALLED.layer is layer
    twice = fake_megatron_parse_args(megatron_lm.extend_args_provider(megatron_lm.extend_args_provider(None)))
    assert twice.sdp4bit and twice.sdp4bit_grad_mode == "ulq"


def _refused(monkeypatch, capsys, argv):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        megatron_lm.wrap_parse_args(fake_megatron_parse_args)()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert not patch.is_installed()
    return err


def test_no_distributed_optimizer_is_refused_when_the_flags_are_parsed(monkeypatch, capsys):
    """Before: a RuntimeError traceback on every rank at the first DDP construction."""
    err = _refused(monkeypatch, capsys, ["--sdp4bit"])
    assert err.startswith("error: SDP4Bit quantizes the distributed optimizer's") and \
        "--use-distributed-optimizer" in err


def test_the_alltoall_baseline_without_distributed_optimizer_is_refused(monkeypatch, capsys):
    err = _refused(monkeypatch, capsys, ["--sdp4bit-preset", "baseline", "--sdp4bit-exact-reduce-scatter",
                                         "alltoall"])
    assert err.startswith("error: --sdp4bit-exact-reduce-scatter alltoall")


def test_cuda_graphs_are_refused_when_the_flags_are_parsed(monkeypatch, capsys):
    err = _refused(monkeypatch, capsys, ["--sdp4bit", "--use-distributed-optimizer", "--cuda-graph-impl",
                                         "local"])
    assert err.startswith("error: SDP4Bit does not support CUDA graphs")


def test_torch_fsdp2_is_refused_as_unsupported(monkeypatch, capsys):
    """Before: told to add --use-distributed-optimizer, which Megatron-LM then rejects with
    FSDP2 (tracebacks on every rank); FSDP2 replaces what the layer quantizes."""
    for extra in ([], ["--use-distributed-optimizer"]):
        err = _refused(monkeypatch, capsys, ["--sdp4bit", "--use-torch-fsdp2", *extra])
        assert err.startswith("error: SDP4Bit does not support torch FSDP2 (--use-torch-fsdp2)"), err


def test_megatron_fsdp_is_refused_as_unsupported_not_sent_to_the_distributed_optimizer(monkeypatch, capsys):
    """Megatron-FSDP needs no --use-distributed-optimizer; before, that was the advice."""
    err = _refused(monkeypatch, capsys, ["--sdp4bit", "--use-megatron-fsdp"])
    assert err.startswith("error: SDP4Bit does not support use_megatron_fsdp"), err


MEGATRON_LM_STYLE_CHECKS = """
def validate_args(args, defaults={}):
    if args.with_message:
        assert args.overlap_grad_reduce, 'Must use --overlap-param-gather with --overlap-grad-reduce'
    assert args.overlap_grad_reduce
"""


def test_megatron_lms_own_assertion_is_one_line_naming_what_failed(monkeypatch, capsys, tmp_path):
    """Megatron-LM's validate_args checks with bare asserts: a traceback on every rank."""
    import importlib.util

    (tmp_path / "arguments.py").write_text(MEGATRON_LM_STYLE_CHECKS)  # a module pytest does not rewrite
    spec = importlib.util.spec_from_file_location("arguments", tmp_path / "arguments.py")
    arguments = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arguments)
    monkeypatch.setenv("RANK", "0")
    validate = routes._refusing_assertions(arguments.validate_args)
    validate(argparse.Namespace(with_message=True, overlap_grad_reduce=True))  # nothing to refuse
    for with_message, said, line in ((True, "Must use --overlap-param-gather with --overlap-grad-reduce", 4),
                                     (False, "`assert args.overlap_grad_reduce` does not hold", 5)):
        with pytest.raises(SystemExit) as exit_info:
            validate(argparse.Namespace(with_message=with_message, overlap_grad_reduce=False))
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1, err
        assert err == f"error: Megatron-LM refuses these arguments: {said} (arguments.py:{line})\n", err


def test_sdp4bit_cpu_outside_the_launcher_is_refused(monkeypatch, capsys):
    """A patched pretrain_gpt.py started directly: before, SDP4BIT_CPU=1 was silently
    ignored (and Megatron-LM died wanting CUDA)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("SDP4BIT_CPU", "1")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2"])
    with pytest.raises(SystemExit) as exit_info:
        fake_megatron_parse_args(megatron_lm.extend_args_provider(None))  # the patch's provider
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: SDP4BIT_CPU=1 is read by the launcher only") and "megatron_sdp4bit.launch" in err
    monkeypatch.setenv("SDP4BIT_CPU", "0")
    assert fake_megatron_parse_args(megatron_lm.extend_args_provider(None)).num_layers == 2


def test_quantization_off_with_nothing_to_refuse_parses(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--sdp4bit-preset", "baseline", "--save", "/tmp/x",
                                      "--ckpt-format", "zarr"])
    args = megatron_lm.wrap_parse_args(fake_megatron_parse_args)()
    assert args.sdp4bit_preset == "baseline"


@pytest.mark.parametrize("argv, refused", [
    (["--save", "ck", "--ckpt-format", "torch_dcp"], True),
    (["--load", "ck", "--ckpt-format", "fsdp_dtensor"], True),
    (["--save", "ck", "--ckpt-format", "torch"], False),
    (["--load", "ck", "--ckpt-format", "torch_dist"], False),
    (["--ckpt-format", "torch_dcp"], False),  # nothing saved or loaded
])
def test_a_checkpoint_format_without_the_layers_state_is_refused(argv, refused):
    parser = argparse.ArgumentParser()
    for flag in ("--save", "--load", "--ckpt-format"):
        parser.add_argument(flag)
    message = refusals.checkpoint_refusal(parser.parse_args(argv), ("torch", "torch_dist"))
    if refused:
        assert message.startswith(f"--ckpt-format {argv[3]}: ") and "torch or torch_dist" in message
    else:
        assert message is None


@pytest.mark.parametrize("argv, refused", [
    (["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "5"], True),
    (["--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "5"], False),
    (["--non-persistent-ckpt-type", "local"], False),  # never saved
])
def test_local_non_persistent_checkpoints_are_refused_before_training(argv, refused):
    """They would be refused at their first save (Megatron-LM's local checkpoint manager
    owns that folder); now when the flags are parsed."""
    parser = argparse.ArgumentParser()
    for flag in ("--save", "--load", "--ckpt-format", "--non-persistent-ckpt-type"):
        parser.add_argument(flag)
    parser.add_argument("--non-persistent-save-interval", type=int)
    message = refusals.checkpoint_refusal(parser.parse_args(argv), ("torch", "torch_dist"))
    if refused:
        assert message.startswith("--non-persistent-ckpt-type local checkpoints cannot carry")
    else:
        assert message is None


@pytest.mark.parametrize("argv, refused", [
    (["--inprocess-restart"], "--inprocess-restart cannot run with SDP4Bit: "),
    (["--save-params-interval", "10", "--overlap-param-gather"],
     "--save-params-interval saves the weights right after the optimizer step"),
    (["--save-params-interval", "10"], None),  # the gathers run in the step: nothing in flight
    (["--overlap-param-gather"], None),
])
def test_loop_features_the_layer_cannot_serve_are_refused_before_training(argv, refused):
    """An in-process restart would reuse the layer's groups and state from before it; a
    params save right after the step would read weights its gathers are still writing."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--inprocess-restart", action="store_true")
    parser.add_argument("--overlap-param-gather", action="store_true")
    parser.add_argument("--save-params-interval", type=int)
    message = refusals.loop_refusal(parser.parse_args(argv))
    if refused is None:
        assert message is None
    else:
        assert message.startswith(refused) and "\n" not in message and "drop" in message


def _megatron_training_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _megatron_training_importable(),
                    reason="megatron.training is not importable (the 0.19.2 wheel ships it)")
def test_the_dataset_helpers_are_hooked_once_while_the_flags_are_parsed(monkeypatch):
    import megatron.core.datasets.utils as datasets_utils

    original = datasets_utils.compile_helpers
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2"])
    fake_megatron_parse_args(megatron_lm.extend_args_provider(megatron_lm.extend_args_provider(None)))
    hooked = datasets_utils.compile_helpers
    assert hooked is not original and getattr(hooked, routes.ROUTE_MARK) is not None
    assert "(built)" in hooked.__doc__  # the wheel's own build imports
    import megatron.training.arguments as arguments

    validate_args = arguments.validate_args
    assert validate_args.__wrapped__ is not None  # Megatron-LM's asserts become one line
    megatron_lm.wrap_parse_args(fake_megatron_parse_args)()
    assert datasets_utils.compile_helpers is hooked  # not wrapped a second time
    assert arguments.validate_args is validate_args
    routes.remove_megatron_lm_hooks()
    assert datasets_utils.compile_helpers is original
    assert not hasattr(arguments.validate_args, "__wrapped__")
