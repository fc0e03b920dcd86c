"""The ``sdp4bit-estimate`` command line: every config runs, bad flags exit 2 with one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_sdp4bit.estimate import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.startswith("gpt_"))
BASE = ["--nodes", "4", "--gpus-per-node", "8", "--intra-gbps", "1600", "--inter-gbps", "200",
        "--tflops", "150"]


@pytest.mark.parametrize("config", CONFIGS)
def test_runs_on_every_config(config, capsys):
    argv = ["--config", os.path.join(REPO, "configs", config), *BASE]
    if config == "gpt_125m.yaml":
        argv += ["--overlap", "full"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "ASSUMED" in out  # no GPU kernel table: the output says so
    for label in ("exact", "ZeRO++", "SDP4Bit"):
        assert label in out
    assert out.count("x |") >= 3  # a speedup per variant


def test_json_output_and_the_cpu_table(capsys):
    assert cli.main(["--config", os.path.join(REPO, "configs", "gpt_350m.yaml"), "--nodes", "2",
                     "--gpus-per-node", "2", "--intra-gbps", "14", "--inter-gbps", "0.1",
                     "--compute-s", "0.5", "--kernels", "cpu", "--cpu-cores-per-rank", "0.5",
                     "--global-batch-size", "32", "--param-dtype", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dp"] == 4 and data["compute_s"] == 0.5 and "measured" in data["kernels"]
    v = data["variants"]
    assert v["baseline"]["speedup"] == 1.0 and v["sdp4bit"]["speedup"] > 1
    assert v["sdp4bit"]["node_inter_bytes"] < v["baseline"]["node_inter_bytes"]
    # Memory the layer adds: nothing for the exact collectives; fp32 params at DP 4 hold
    # the main shard and the set-aside reconstruction, 2 x 4 bytes / 4 per parameter.
    assert v["baseline"]["memory_held_bytes"] == v["baseline"]["memory_buffer_bytes"] == \
        v["baseline"]["memory_scratch_bytes"] == 0
    held = v["sdp4bit"]["memory_held_bytes"] / v["sdp4bit"]["memory_params"]
    assert held == pytest.approx(2.0, rel=0.01) and v["sdp4bit"]["memory_buffer_bytes"] > 0


def test_report_states_the_memory_the_layer_adds(capsys):
    assert cli.main(["--config", os.path.join(REPO, "configs", "gpt_1.3b.yaml"), *BASE]) == 0
    out = capsys.readouterr().out
    assert "Memory the layer adds per GPU" in out
    memory_table = out[out.index("Memory the layer adds per GPU"):]
    row = next(line for line in memory_table.splitlines() if line.startswith("| SDP4Bit"))
    held, buffers, scratch, total = (float(x) for x in row.split("|")[2:6])
    assert held == pytest.approx(4 / 32, abs=0.01)  # DP 32, bf16 params: one fp32 main shard
    assert total <= 1.0  # the goal: at most a byte per parameter with DP >= 8


BAD = [
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "two"], "--nodes"),
    (["--inter-gbps", "-1"], "--inter-gbps"),
    (["--tflops", "nan"], "--tflops"),
    (["--tp", "3"], "--tp"),
    (["--tp", "8", "--pp", "3", "--nodes", "6"], "--pp"),         # 32 layers: PP 3 does not divide
    (["--dp", "7"], "--dp"),
    (["--config", "configs/nope.yaml"], "--config"),
    (["--compute-s", "1"], "--compute-s"),                          # with --tflops: one of them
    (["--variants", "baseline,fsdp"], "--variants"),
    (["--global-batch-size", "100"], "--global-batch-size"),
    (["--kernel-gbps", "100", "--kernels", "cpu"], "--kernel-gbps"),
    (["--overlap", "sometimes"], "--overlap"),
    (["--frobnicate"], "--frobnicate"),
    (["--latency-us", "1,2"], "--latency-us"),
    (["--latency-us", "1,-2,3,4"], "--latency-us"),
    (["--kernel-rates", "/nonexistent/bench.json"], "--kernel-rates"),
    (["--kernel-rates", "bench.json", "--kernels", "cpu"], "--kernels"),
    (["--cluster-type", "tpu-pod"], "--cluster-type"),
    (["--stream-gbps", "0"], "--stream-gbps"),
]


@pytest.mark.parametrize("extra,flag", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_flags_exit_2_with_one_line_naming_the_flag(extra, flag, capsys):
    config = "gpt_6.7b.yaml" if flag == "--pp" else "gpt_1.3b.yaml"
    argv = ["--config", os.path.join(REPO, "configs", config), *BASE, *extra]
    if flag == "--config":
        argv = [*BASE, *extra]
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and captured.out == ""
    assert len(lines) == 1 and lines[0].startswith("sdp4bit-estimate: error:"), lines
    assert flag in lines[0], lines[0]


def test_missing_flags_are_named():
    proc = subprocess.run([sys.executable, "-m", "megatron_sdp4bit.estimate", "--nodes", "2"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("sdp4bit-estimate: error:")
    assert "--gpus-per-node" in line and "--inter-gbps" in line


def test_an_estimate_imports_nothing_of_megatron():
    """Issue 29: the planner, which starts no process, imported megatron's model stack
    (GPTModel, DDP, the optimizer) for the vocabulary's padding, a one-line ceiling."""
    code = ("import contextlib, io, sys\n"
            "from megatron_sdp4bit.estimate import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert cli.main({['--config', 'configs/gpt_350m.yaml', '--tp', '2', *BASE]!r}) == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformer_engine')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_cluster_type_without_nodes_asks_for_the_nodes_only(capsys):
    """Issue 28, round two: it said "(or take a cluster's with --cluster-type)" to a
    command that had one."""
    assert cli.main(["--cluster-type", "h800-ib"]) == 2
    assert capsys.readouterr().err.strip() == (
        "sdp4bit-estimate: error: --nodes: the following arguments are required: --nodes (--cluster-type h800-ib "
        "gives the rest, not how many nodes)")


def test_an_empty_config_path_is_refused_rather_than_the_default_model_estimated(capsys):
    """Issue 28, round two: ``--config "$CONFIG"`` with CONFIG unset estimated the driver's
    default model (2 layers x 128) under the user's cluster, without a word."""
    assert cli.main(["--config", "", "--cluster-type", "h800-ib", "--nodes", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "sdp4bit-estimate: error: --config was given an empty path (an empty variable?): pass the YAML file, or "
        "drop --config to estimate the driver's default model")


def test_cluster_type_gives_the_defaults_and_flags_win(capsys):
    from megatron_sdp4bit.estimate.clusters import A100_SLINGSHOT

    base = ["--config", os.path.join(REPO, "configs", "gpt_1.3b.yaml"), "--nodes", "4",
            "--cluster-type", "a100-slingshot", "--json"]
    assert cli.main(base) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpus_per_node"] == A100_SLINGSHOT.gpus_per_node
    assert (data["inter_gbps"], data["stream_gbps"]) == (A100_SLINGSHOT.inter_gbps,
                                                          A100_SLINGSHOT.stream_gbps)
    assert data["latency_us"]["inter"] == A100_SLINGSHOT.latency.inter_us
    assert data["implementation"] == "megatron_sdp4bit.comm"
    assert cli.main(base + ["--inter-gbps", "50", "--latency-us", "0,0,0,0", "--tflops", "10",
                            "--implementation", "paper-reference"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inter_gbps"] == 50
    assert data["latency_us"] == {"call": 0, "intra": 0, "inter": 0, "message": 0}
    assert data["variants"]["baseline"]["grad_latency_s"] == 0
    assert data["implementation"] == "the paper's reference code"


def test_command_line_constants_match_the_modules():
    from megatron_sdp4bit.estimate import timing, volume

    assert tuple(volume.EXACT_REDUCE_SCATTERS) == cli.EXACT_REDUCE_SCATTERS
    assert tuple(timing.VARIANTS) == cli.VARIANT_NAMES


def test_a_tensor_parallel_group_across_nodes_is_refused_naming_the_numbers(capsys):
    """Issue 28: 2 nodes x 6 GPUs at TP 4 was costed at the intra-node rate (2.9 s per
    step, 1.06x) though ranks 4-7 straddle the two nodes; scripts/pretrain_gpt.sh
    refuses that layout. TP that divides a node's GPUs, or spans whole nodes, runs."""
    argv = ["--config", os.path.join(REPO, "configs", "gpt_1.3b.yaml"), "--nodes", "2", "--gpus-per-node", "6",
            "--intra-gbps", "1600", "--inter-gbps", "200", "--tflops", "150", "--global-batch-size", "12"]
    assert cli.main(argv + ["--tp", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == (
        "sdp4bit-estimate: error: --tp 4 does not divide the 6 GPUs of a node (--gpus-per-node): "
        "tensor-parallel group 1 (ranks 4-7) would straddle nodes 0 and 1, which this estimate does not "
        "cost; pass a --tp that divides 6 (1, 2, 3, 6) or a multiple of it")
    for tp in ("1", "2"):  # the fix it names (16 heads: 3 and 6 do not divide them)
        assert cli.main(argv + ["--tp", tp, "--global-batch-size", "48"]) == 0, tp
    whole_nodes = ["--gpus-per-node", "4", "--tp", "8", "--global-batch-size", "4"]  # TP over both nodes
    assert cli.main(argv + whole_nodes) == 0
    capsys.readouterr()


def test_layouts_whose_pipeline_stages_or_dp_groups_straddle_nodes_are_costed_as_megatron_places_them():
    """TP 2 x PP 3 on 2 nodes x 6: stage 1 (ranks 4-7) straddles the nodes; its DP groups
    ({4, 6}, {5, 7}) cross the network, stage 0's ({0, 2}, {1, 3}) do not. The busiest
    stage sets the pace, so the step's DP traffic is a crossing group's."""
    from megatron_sdp4bit.estimate import volume

    layouts = dict((stage, layout) for stage, layout in volume.dp_layouts(2, 6, 2, 3))
    groups = volume.megatron_dp_groups(12, tp=2, pp=3)
    assert [ranks for stage, ranks in groups if stage == 1] == [[4, 6], [5, 7]]
    assert layouts[0].num_nodes == 1 and layouts[1].num_nodes == 2


@pytest.mark.parametrize("extra, words", [
    (["--hidden-size", "100"], "--hidden-size 100 is not divisible by --num-attention-heads 16"),
    (["--num-attention-heads", "7"], "--hidden-size 2048 is not divisible by --num-attention-heads 7"),
])
def test_a_model_megatron_cannot_build_is_refused(extra, words, capsys):
    """Before: estimated as if it could be built."""
    assert cli.main(["--config", os.path.join(REPO, "configs", "gpt_1.3b.yaml"), *BASE, *extra]) == 2
    assert words in capsys.readouterr().err
