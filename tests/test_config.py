"""SDP4BitConfig validation, presets and the argparse flags' round trip."""
import argparse
import dataclasses

import pytest

from megatron_sdp4bit.config import PRESETS, SDP4BitConfig, preset
from megatron_sdp4bit.megatron.args import add_sdp4bit_args, config_from_args, config_to_argv


def parse(argv):
    return add_sdp4bit_args(argparse.ArgumentParser()).parse_args(argv)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(weight_mode="qwd"), r"weight_mode='qwd'; choose one of \('diff', 'direct', 'off'\) "
                                  r"\(or weight-differences, weights, exact\)"),
        (dict(grad_mode="qsgd"), r"grad_mode='qsgd'; choose one of"),
        (dict(rounding="up"), r"rounding='up'; choose one of \('stochastic', 'nearest'\)"),
        (dict(weight_bits=3), r"weight_bits=3 is not supported; use one of \(2, 4, 8\)"),
        (dict(weight_bits=True), r"weight_bits=True is not supported"),
        (dict(grad_bits_intra=16), r"grad_bits_intra=16 is not supported; use one of"),
        (dict(grad_bits_inter=1), r"grad_bits_inter=1 is not supported; use one of"),
        (dict(weight_group_size=0), r"weight_group_size=0 must be an integer >= 1"),
        (dict(weight_group_size=-64), r"weight_group_size=-64 must be an integer >= 1"),
        (dict(weight_group_size=2048.0), r"weight_group_size=2048.0 must be an integer"),
        (dict(weight_group_size=3), r"weight_group_size=3 must be a positive multiple of 2"),
        (dict(weight_bits=2, weight_group_size=2050), r"weight_group_size=2050 must be a positive multiple of 4"),
        (dict(grad_mode="tlq", grad_bits_inter=2, grad_group_size_inter=130),
         r"grad_group_size_inter=130 must be a positive multiple of 4"),
        (dict(grad_mode="tlq", grad_group_size_intra=0), r"grad_group_size_intra=0 must be an integer >= 1"),
        (dict(hadamard_block=24), r"hadamard_block=24 must be a power of two in 2..256"),
        (dict(hadamard_block=512), r"hadamard_block=512 must be a power of two in 2..256"),
        (dict(hadamard_block=1), r"hadamard_block=1 must be an integer >= 2"),
        (dict(grad_group_size_intra=100), r"grad_group_size_intra=100 is not a multiple of hadamard_block=32"),
        (dict(grad_group_size_inter=48), r"grad_group_size_inter=48 is not a multiple of hadamard_block=32"),
        (dict(ranks_per_node=0), r"ranks_per_node=0 must be an integer >= 1 or None"),
        (dict(ranks_per_node="2"), r"ranks_per_node='2' must be an integer >= 1"),
        (dict(pipeline_chunks=0), r"pipeline_chunks=0 must be an integer >= 1"),
        (dict(seed=-1), r"seed=-1 must be an integer >= 0"),
        (dict(grad_start_iter=-5), r"grad_start_iter=-5 must be an integer >= 0"),
        (dict(check_interval=-1), r"check_interval=-1 must be an integer >= 0"),
        (dict(check_interval=2.5), r"check_interval=2.5 must be an integer >= 0"),
        (dict(runner="nccl"), r"runner='nccl'; choose one of \('auto', 'inline', 'thread', "
                              r"'stream', 'deferred'\)"),
    ],
)
def test_bad_values_say_what_to_change(changes, message):
    with pytest.raises(ValueError, match=message):
        SDP4BitConfig(**changes)


def test_a_made_config_cannot_be_changed_past_its_checks():
    config = SDP4BitConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.weight_group_size = 3  # would only have failed at the first collective
    with pytest.raises(ValueError, match="weight_group_size=3 must be a positive multiple of 2"):
        config.replace(weight_group_size=3)


def test_valid_edge_values_are_accepted():
    # Without Hadamard the grad group sizes need only fill whole bytes.
    SDP4BitConfig(grad_mode="tlq", grad_group_size_intra=100, grad_group_size_inter=2)
    SDP4BitConfig(weight_bits=8, weight_group_size=3, hadamard_block=256,
                  grad_group_size_intra=256, grad_group_size_inter=512)
    SDP4BitConfig(hadamard_block=2, grad_group_size_intra=2, grad_group_size_inter=2,
                  ranks_per_node=1, grad_start_iter=0, seed=0)


def test_presets():
    assert preset("sdp4bit") == SDP4BitConfig()
    zeropp = preset("zeropp")
    assert zeropp.weight_mode == "direct" and zeropp.grad_mode == "ulq"
    assert zeropp.effective_grad_bits_intra == 4 and not zeropp.use_hadamard
    assert not preset("baseline").enabled
    with pytest.raises(ValueError, match="unknown preset"):
        preset("fast")


def test_fingerprint_changes_with_every_field():
    base = SDP4BitConfig()
    seen = {base.fingerprint()}
    for changes in [dict(weight_bits=8), dict(grad_mode="tlq"), dict(seed=7),
                    dict(ranks_per_node=2), dict(pipeline_chunks=4)]:
        seen.add(base.replace(**changes).fingerprint())
    assert len(seen) == 6


def test_no_flags_means_no_config():
    assert config_from_args(parse([])) is None


def test_sdp4bit_flag_is_the_paper_preset():
    assert config_from_args(parse(["--sdp4bit"])) == PRESETS["sdp4bit"]


def test_field_flags_override_preset():
    cfg = config_from_args(parse(["--sdp4bit", "--sdp4bit-grad-mode", "tlq",
                                  "--sdp4bit-ranks-per-node", "2"]))
    assert cfg.grad_mode == "tlq" and cfg.ranks_per_node == 2 and cfg.weight_mode == "diff"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_field_round_trips(name):
    cfg = PRESETS[name].replace(ranks_per_node=2, pipeline_chunks=3, seed=99,
                                grad_start_iter=5, rounding="nearest", runner="inline")
    assert config_from_args(parse(config_to_argv(cfg))) == cfg


def test_every_field_has_a_flag():
    parser = add_sdp4bit_args(argparse.ArgumentParser())
    options = {s for a in parser._actions for s in a.option_strings}
    for field in dataclasses.fields(SDP4BitConfig):
        assert "--sdp4bit-" + field.name.replace("_", "-") in options


def test_reference_fork_aliases():
    argv = ["--quantized-weights", "--weight-quantization-bits", "4", "--wq-group-size", "2048",
            "--quantized-gradients", "--gradient-quantization-bits-intra", "8",
            "--gradient-quantization-bits-inter", "4", "--gq-group-size-intra", "128",
            "--gq-group-size-inter", "128", "--hadamard-transform",
            "--gradient-alltoall-pipeline", "2", "--gradients-quantization-start-iteration", "10"]
    cfg = config_from_args(parse(argv))
    assert cfg == PRESETS["sdp4bit"].replace(pipeline_chunks=2, grad_start_iter=10)
    assert config_from_args(parse(["--quantized-gradients"])).grad_mode == "tlq"
    assert config_from_args(parse(["--quantized-gradients"])).weight_mode == "off"


def test_bad_flag_value_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of hadamard_block"):
        config_from_args(parse(["--sdp4bit", "--sdp4bit-grad-group-size-intra", "100"]))


def test_the_gradient_hops_formats_are_decided_by_the_config():
    """One definition of each hop's format and of a chunk's alignment, which the
    collectives, their memory and kernel plans, the error bound and the estimator read."""
    sdp = preset("sdp4bit")
    assert sdp.grad_hop_format("intra") == (8, 128) and sdp.grad_hop_format("inter") == (4, 128)
    assert preset("zeropp").grad_hop_format("intra") == (4, 128)  # ULq: low width on both
    assert sdp.grad_hadamard_block == 32 and preset("zeropp").grad_hadamard_block is None
    tlq = sdp.replace(grad_mode="tlq", grad_group_size_intra=256, grad_group_size_inter=96)
    assert tlq.grad_alignment(["intra", "inter"]) == 768 and tlq.grad_alignment(["inter"]) == 96
    assert sdp.grad_alignment(["intra"]) == 128
    with pytest.raises(ValueError, match="'intra' or 'inter'"):
        sdp.grad_hop_format("node")


def test_readable_mode_names_stand_for_the_papers_acronyms():
    # the config keeps the acronym: equal configs, saved configs and fingerprints unchanged
    readable = SDP4BitConfig(weight_mode="weight-differences", grad_mode="two-level-hadamard")
    assert readable == SDP4BitConfig() and readable.fingerprint() == SDP4BitConfig().fingerprint()
    assert SDP4BitConfig(weight_mode="weights", grad_mode="two-level-uniform") == \
        SDP4BitConfig(weight_mode="direct", grad_mode="ulq")
    assert SDP4BitConfig(weight_mode="exact", grad_mode="exact").to_dict()["grad_mode"] == "off"
    assert SDP4BitConfig().describe() == (
        "weight all-gather 4-bit weight differences (qWD); gradient reduce-scatter 8-bit "
        "intra-node, 4-bit inter-node after a 32-point Hadamard rotation (TLq-HS); "
        "stochastic rounding")
