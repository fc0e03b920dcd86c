"""The driver with tensor, pipeline and virtual-pipeline parallelism on 4 gloo ranks.

One spawned world of 4 CPU ranks runs three layouts one after another -- TP2 x DP2,
PP2 x DP2 and PP2 with 2 virtual chunks (interleaved schedule) x DP2 -- with the
two data-parallel ranks of every group as 2 emulated nodes of one rank each
(``--sdp4bit-ranks-per-node 1``). Per layout: an exact run (preset baseline), an
SDP4Bit run, and the SDP4Bit run split in two by a checkpoint. The tests read the
results: loss close to the exact run, data-parallel replicas bit-identical after
every step, resume bit-identical, and every model chunk's data-parallel
collectives quantized (counted per chunk from the wire accounting).
Bad layouts are refused with one line naming the flag (``parallel_layout``).
"""
from __future__ import annotations

import os
from collections import defaultdict

import pytest

from driver_runs import count_collectives_per_chunk, driver_world, refusal, train_log

STEPS, SAVED_AT = 6, 3
COMMON = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--use-distributed-optimizer", "--lr-decay-iters", str(STEPS),
    "--lr-warmup-iters", "1", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--bf16",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    "--default-corpus-mb", "1", "--split", "90,10,0", "--no-progress-bar",
    "--sdp4bit-ranks-per-node", "1",  # DP=2: two emulated nodes of one rank
]
EXACT = ["--sdp4bit-preset", "baseline"]
SDP = ["--sdp4bit", "--sdp4bit-check-interval", "2"]  # the layer's replica check runs too
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "pp2vp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
}
CHUNKS = {"tp2": 1, "pp2": 1, "pp2vp2": 2}


# --- inside a rank ------------------------------------------------------------------------

def _layouts_world(rank, world_size, root):
    from driver_runs import run_with_hashes
    from megatron_sdp4bit.pretrain import run
    from megatron_sdp4bit.training.arguments import ArgumentError, parse_args

    def go(name, extra, iters):
        args = parse_args(COMMON + extra + ["--train-iters", str(iters),
                                            "--run-dir", os.path.join(root, name)])
        counts = {}
        summary = run_with_hashes(args, prepare=count_collectives_per_chunk(counts))
        summary["collectives_per_chunk"] = {k: dict(v) for k, v in counts.items()}
        return summary

    def resumed(name, extra, iters):
        """A refused --load fails this layout's resume test only (the checkpoint code
        raises on every rank alike), not the whole module."""
        from megatron_sdp4bit.training.checkpoint import CheckpointError

        try:
            return go(name, extra, iters)
        except (CheckpointError, RuntimeError, KeyError, ValueError) as error:
            return {"error": f"{type(error).__name__}: {error}"}

    results = {}
    for layout, flags in LAYOUTS.items():
        ckpt = os.path.join(root, f"{layout}-ckpt")
        results[layout] = {
            "exact": go(f"{layout}-exact", flags + EXACT, STEPS),
            "sdp": go(f"{layout}-sdp", flags + SDP, STEPS),
            "first_half": go(f"{layout}-first_half", flags + SDP + ["--save", ckpt], SAVED_AT),
            "second_half": resumed(f"{layout}-second_half", flags + SDP + ["--load", ckpt], STEPS),
        }
    # the world check happens in run(), before anything is built
    results["bad_world"] = refusal(
        lambda: run(parse_args(COMMON + SDP + ["--tensor-model-parallel-size", "3", "--num-attention-heads", "3",
                                               "--hidden-size", "66", "--train-iters", "1"])),
        ArgumentError)
    return results


# --- the tests ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return driver_world(tmp_path_factory, "layouts", _layouts_world, 4, timeout_s=900, start="spawn")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_is_what_was_asked(runs, layout):
    _, results = runs
    expected = {"tp2": "TP 2 x PP 1 x DP 2", "pp2": "TP 1 x PP 2 x DP 2",
                "pp2vp2": "TP 1 x PP 2 x VP 2 x DP 2"}[layout]
    assert {r[layout]["sdp"]["layout"] for r in results} == {expected}
    coordinates = {(r[layout]["sdp"]["tp_rank"], r[layout]["sdp"]["pp_rank"], r[layout]["sdp"]["dp_rank"])
                   for r in results}
    assert len(coordinates) == 4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_close_to_the_exact_run(runs, layout):
    root, _ = runs
    exact, sdp = train_log(root, f"{layout}-exact"), train_log(root, f"{layout}-sdp")
    assert sorted(sdp) == list(range(1, STEPS + 1))
    differences = [abs(sdp[i] - exact[i]) for i in range(1, STEPS + 1)]
    print(f"{layout}: exact {exact[STEPS]:.4f}, sdp4bit {sdp[STEPS]:.4f}, "
          f"largest step difference {max(differences):.4f}")
    assert exact[STEPS] < exact[1] and sdp[STEPS] < sdp[1]
    assert max(differences) < 0.02 * exact[STEPS]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_data_parallel_replicas_bit_identical_after_every_step(runs, layout):
    _, results = runs
    for name in ("exact", "sdp", "second_half"):
        if name == "second_half" and "error" in results[0][layout][name]:
            continue  # test_resume_is_bit_identical reports it
        replicas = defaultdict(list)
        for r in results:
            run = r[layout][name]
            replicas[(run["tp_rank"], run["pp_rank"])].append(run["weights_sha256_per_step"])
        assert len(replicas) == 2  # two model-parallel ranks, each with 2 DP replicas
        for coordinates, per_step in replicas.items():
            assert len(per_step) == 2 and len(per_step[0]) >= 1, coordinates
            assert per_step[0] == per_step[1], (name, coordinates)
        # different model-parallel ranks hold different weights
        assert len({tuple(steps[0]) for steps in replicas.values()}) == 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_is_bit_identical(runs, layout):
    root, results = runs
    for r in results:
        assert "error" not in r[layout]["second_half"], r[layout]["second_half"]["error"]
    straight = train_log(root, f"{layout}-sdp")
    resumed = {**train_log(root, f"{layout}-first_half"), **train_log(root, f"{layout}-second_half")}
    assert [resumed[i] for i in range(1, STEPS + 1)] == [straight[i] for i in range(1, STEPS + 1)]
    for r in results:
        assert r[layout]["second_half"]["weights_sha256"] == r[layout]["sdp"]["weights_sha256"]
        assert r[layout]["second_half"]["weights_sha256_per_step"] == \
            r[layout]["sdp"]["weights_sha256_per_step"][SAVED_AT:]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_chunk_quantizes_its_data_parallel_collectives(runs, layout):
    _, results = runs
    for r in results:
        sdp, exact = r[layout]["sdp"]["collectives_per_chunk"], r[layout]["exact"]["collectives_per_chunk"]
        assert sorted(sdp) == list(range(CHUNKS[layout]))
        for chunk, counts in sdp.items():
            groups = counts["bucket groups"]
            # one reduce-scatter and one all-gather per bucket group and step, all quantized
            assert counts.get("reduce_scatter quantized") == STEPS * groups, (chunk, counts)
            assert counts.get("all_gather quantized") == STEPS * groups, (chunk, counts)
            assert "reduce_scatter exact" not in counts and "all_gather exact" not in counts
        for chunk, counts in exact.items():
            assert counts.get("reduce_scatter exact") == STEPS * counts["bucket groups"], (chunk, counts)
            assert "reduce_scatter quantized" not in counts and "all_gather quantized" not in counts


def test_a_world_the_layout_does_not_divide_is_refused_in_run(runs):
    _, results = runs
    for r in results:
        assert r["bad_world"] == ("the world size 4 is not divisible by --tensor-model-parallel-size 3 x "
                                  "--pipeline-model-parallel-size 1 = 3")


# --- bad layouts, without a world ---------------------------------------------------------

def _layout(flags, world):
    from megatron_sdp4bit.training.arguments import parse_args
    from megatron_sdp4bit.training.distributed import parallel_layout

    return parallel_layout(parse_args(flags), world)


@pytest.mark.parametrize("flags, world, flag_named", [
    (["--tensor-model-parallel-size", "3", "--num-attention-heads", "3", "--hidden-size", "66"], 4,
     "--tensor-model-parallel-size 3"),
    (["--pipeline-model-parallel-size", "3", "--num-layers", "3"], 4, "--pipeline-model-parallel-size 3"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 4, "--num-layers 3"),
    (["--num-layers", "6", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "2"], 4, "--num-layers-per-virtual-pipeline-stage 2"),
    (["--num-attention-heads", "4", "--tensor-model-parallel-size", "8"], 8, "--num-attention-heads 4"),
    (["--ffn-hidden-size", "100", "--tensor-model-parallel-size", "8", "--num-attention-heads", "8"], 8,
     "--ffn-hidden-size 100"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 4, "--num-layers-per-virtual-pipeline-stage"),
    (["--tensor-model-parallel-size", "0"], 4, "--tensor-model-parallel-size"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
      "1", "--micro-batch-size", "2", "--global-batch-size", "12"], 4, "--global-batch-size 12"),
])
def test_bad_layouts_are_refused_in_one_line_naming_the_flag(flags, world, flag_named):
    from megatron_sdp4bit.training.arguments import ArgumentError

    with pytest.raises(ArgumentError) as error:
        _layout(flags, world)
    message = str(error.value)
    assert flag_named in message and "\n" not in message, message


def test_good_layouts():
    assert _layout(["--tensor-model-parallel-size", "2"], 8).describe() == "TP 2 x PP 1 x DP 4"
    layout = _layout(["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                      "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "16",
                      "--micro-batch-size", "2"], 8)
    assert (layout.tensor, layout.pipeline, layout.virtual, layout.data, layout.model_chunks) == (1, 2, 2, 4, 2)
    # one virtual stage per pipeline stage is no interleaving (Megatron-LM's rule)
    assert _layout(["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "2"], 2).virtual is None


# --- scripts/pretrain_gpt.sh: TP/PP from the config, checked before torchrun --------------

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(size, env, *flags):
    """Run the launcher with a python that prints the torchrun command instead of running it."""
    import subprocess
    import sys

    wrapper = os.path.join(env["TMP"], "python")
    with open(wrapper, "w") as f:
        f.write('#!/bin/sh\nif [ "$1 $2" = "-m torch.distributed.run" ]; then echo "LAUNCH $*"; exit 0; fi\n'
                f'exec {sys.executable} "$@"\n')
    os.chmod(wrapper, 0o755)
    return subprocess.run(["bash", os.path.join(REPO, "scripts", "pretrain_gpt.sh"), size, *flags],
                          env={**os.environ, **env, "PYTHON": wrapper}, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("size, env, flags, layout", [
    ("6.7b", {"NNODES": "2", "GPUS_PER_NODE": "8"}, [], "TP 4 x PP 1 x DP 4 on 2 node(s) x 8 GPUs"),
    ("125m", {"GPUS_PER_NODE": "4"}, [], "TP 1 x PP 1 x DP 4 on 1 node(s) x 4 GPUs"),
    ("6.7b", {"NNODES": "4", "GPUS_PER_NODE": "4"}, ["--pipeline-model-parallel-size", "2"],
     "TP 4 x PP 2 x DP 2 on 4 node(s) x 4 GPUs"),
])
def test_launcher_takes_tp_and_pp_from_the_config(tmp_path, size, env, flags, layout):
    node_rank = str(int(env.get("NNODES", "1")) - 1)  # the last node
    done = _launch(size, {**env, "TMP": str(tmp_path), "NODE_RANK": node_rank, "MASTER_ADDR": "node0"}, *flags)
    assert done.returncode == 0, done.stderr
    assert f"GPT-{size}: {layout}" in done.stderr
    command = done.stdout.strip()
    assert command.startswith("LAUNCH -m torch.distributed.run")
    for part in (f"--nnodes {env.get('NNODES', '1')}", f"--node-rank {node_rank}", "--master-addr node0",
                 f"--nproc-per-node={env['GPUS_PER_NODE']}", f"--config {REPO}/configs/gpt_{size}.yaml"):
        assert part in command, (part, command)


@pytest.mark.parametrize("env, flags, message", [
    ({"GPUS_PER_NODE": "2"}, [], "--tensor-model-parallel-size 4 does not divide the 2 GPUs of a node"),
    ({"GPUS_PER_NODE": "4", "NNODES": "1"}, ["--pipeline-model-parallel-size", "3", "--num-layers", "33"],
     "the world size 4 is not divisible by --tensor-model-parallel-size 4 x --pipeline-model-parallel-size 3"),
])
def test_launcher_refuses_a_layout_the_machines_do_not_fit(tmp_path, env, flags, message):
    done = _launch("6.7b", {**env, "TMP": str(tmp_path)}, *flags)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "LAUNCH" not in done.stdout
