"""The driver with a mixture-of-experts model (``--num-experts``) on 4 gloo ranks.

One spawned world of 4 CPU ranks, 2 emulated nodes x 2 (``--sdp4bit-ranks-per-node 2``),
expert-parallel 2: the expert-parallel groups are {0, 1} and {2, 3}, so each
expert-data-parallel group ({0, 2}, {1, 3}) spans both nodes and its buckets take both
hops on groups of their own, beside the dense DP-4 buckets. Runs: the same model
dense and with experts, both with Megatron's overlap flags (as users train); the MoE
run without them, its collectives counted per bucket group; the overlapped MoE run
split in two by a checkpoint, and in fp32. The tests read: each expert-parallel rank
starts from experts of its own, the loss falls, the replicas of each expert-parallel
rank are bit-identical after every step (the two ranks hold other experts), the
layer's replica check ran for both optimizers of megatron's chain every step, every
expert bucket group's collectives were quantized, the MoE run's bytes ratio is within
0.05 of the dense run's, and the resume is bit-identical, in bf16 and with fp32
params (whose checkpoint carries both optimizers' exact main shards). Bad
mixture-of-experts flags are refused in one line naming the flag.
"""
from __future__ import annotations

import hashlib
import os
from collections import defaultdict

import pytest

from driver_runs import count_collectives_per_chunk, driver_world, refusal, train_log

STEPS, SAVED_AT = 6, 3
COMMON = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--lr-decay-iters", str(STEPS), "--bf16",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    "--default-corpus-mb", "1", "--split", "90,10,0", "--no-progress-bar",
    "--sdp4bit", "--sdp4bit-ranks-per-node", "2", "--sdp4bit-check-interval", "1",
]
FP32, FP32_STEPS = [flag for flag in COMMON if flag != "--bf16"], SAVED_AT + 2
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather", "--bucket-size", "20000"]
EXPERTS = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2"]


def _experts_sha256(chunks) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".experts." in name:
                digest.update(param.detach().float().numpy().tobytes())
    return digest.hexdigest()


def _experts_world(rank, world_size, root):
    from driver_runs import run_with_hashes
    from megatron_sdp4bit.training.arguments import parse_args
    from megatron_sdp4bit.training.checkpoint import CheckpointError

    def go(name, extra, iters=STEPS, counts=None, common=COMMON):
        args = parse_args(common + extra + ["--train-iters", str(iters), "--run-dir", os.path.join(root, name)])
        counting = count_collectives_per_chunk(counts) if counts is not None else None
        at_start = {}

        def prepare(parts):
            at_start["experts"] = _experts_sha256(parts.model)
            if counting is not None:
                counting(parts)

        summary = run_with_hashes(args, prepare=prepare)
        summary["experts_at_start"] = at_start["experts"]
        if counts is not None:
            summary["collectives_per_chunk"] = {k: dict(v) for k, v in counts.items()}
        return summary

    ckpt = os.path.join(root, "ckpt")
    results = {
        "dense": go("dense", OVERLAP),
        "moe": go("moe", OVERLAP + EXPERTS),
        "moe_sync": go("moe_sync", EXPERTS, counts={}),
        "first_half": go("first_half", OVERLAP + EXPERTS + ["--save", ckpt], SAVED_AT),
        "second_half": go("second_half", OVERLAP + EXPERTS + ["--load", ckpt]),
        # fp32 params: the checkpoint carries each optimizer's exact main shards
        "fp32": go("fp32", OVERLAP + EXPERTS, FP32_STEPS, common=FP32),
        "fp32_first": go("fp32_first", OVERLAP + EXPERTS + ["--save", ckpt + "_fp32"], SAVED_AT, common=FP32),
        "fp32_second": go("fp32_second", OVERLAP + EXPERTS + ["--load", ckpt + "_fp32"], FP32_STEPS, common=FP32),
    }
    # the checkpoint holds half the experts per rank: another EP is refused
    results["other_ep"] = refusal(lambda: go("other_ep", OVERLAP + ["--num-experts", "4", "--load", ckpt]),
                                  CheckpointError)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return driver_world(tmp_path_factory, "experts", _experts_world, 4, timeout_s=900, start="spawn")


def test_the_layout_names_the_expert_parallel_groups(runs):
    _, results = runs
    assert {r["moe"]["layout"] for r in results} == {"TP 1 x PP 1 x DP 4 (EP 2 x expert DP 2)"}
    assert sorted((r["moe"]["dp_rank"], r["moe"]["ep_rank"]) for r in results) == [(0, 0), (1, 1), (2, 0), (3, 1)]


def test_the_loss_falls_and_the_replica_check_runs_for_both_optimizers_every_step(runs):
    root, results = runs
    losses = train_log(root, "moe")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1], losses
    for r in results:
        # megatron chains a dense and an expert distributed optimizer; each checks its own
        assert r["moe"]["replica_checks_passed"] == 2 * STEPS, r["moe"]
        assert r["dense"]["replica_checks_passed"] == STEPS, r["dense"]


def test_replicas_of_each_expert_parallel_rank_are_bit_identical_after_every_step(runs):
    _, results = runs
    for name in ("moe", "moe_sync", "second_half"):
        by_expert_rank = defaultdict(list)
        for r in results:
            by_expert_rank[r[name]["ep_rank"]].append(r[name]["weights_sha256_per_step"])
        assert sorted(by_expert_rank) == [0, 1]
        for ep_rank, per_step in by_expert_rank.items():
            assert len(per_step) == 2 and per_step[0] == per_step[1], (name, ep_rank)
        assert by_expert_rank[0][0][-1] != by_expert_rank[1][0][-1]  # other experts


def test_each_expert_parallel_rank_starts_from_experts_of_its_own(runs):
    # on CPU megatron draws all weights from one seed; the driver draws the experts
    # per expert-parallel rank, as megatron's expert RNG tracker does on GPUs
    _, results = runs
    by_expert_rank = defaultdict(set)
    for r in results:
        by_expert_rank[r["moe"]["ep_rank"]].add(r["moe"]["experts_at_start"])
    assert [len(by_expert_rank[e]) for e in (0, 1)] == [1, 1], by_expert_rank
    assert by_expert_rank[0] != by_expert_rank[1]


def test_every_expert_bucket_group_is_quantized(runs):
    _, results = runs
    for r in results:
        counts, = r["moe_sync"]["collectives_per_chunk"].values()
        assert counts["expert bucket groups"] >= 1 and counts["bucket groups"] >= 1, counts
        for kind in ("", "expert "):
            groups = counts[f"{kind}bucket groups"]
            assert counts.get(f"{kind}reduce_scatter quantized") == STEPS * groups, counts
            assert counts.get(f"{kind}all_gather quantized") == STEPS * groups, counts
        assert not [key for key in counts if key.endswith(" exact")], counts


def test_the_bytes_ratio_is_within_0_05_of_the_dense_run(runs):
    _, results = runs
    for r in results:
        dense, moe = (r[name]["bytes_sent"] / r[name]["bytes_exact"] for name in ("dense", "moe"))
        print(f"bytes sent / exact: dense {dense:.3f}, MoE {moe:.3f}")
        assert abs(moe - dense) < 0.05, (moe, dense)


def test_resume_is_bit_identical(runs):
    root, results = runs
    straight = train_log(root, "moe")
    resumed = {**train_log(root, "first_half"), **train_log(root, "second_half")}
    assert [resumed[i] for i in range(1, STEPS + 1)] == [straight[i] for i in range(1, STEPS + 1)]
    for r in results:
        assert r["second_half"]["weights_sha256"] == r["moe"]["weights_sha256"]
        assert r["second_half"]["weights_sha256_per_step"] == r["moe"]["weights_sha256_per_step"][SAVED_AT:]


def test_an_fp32_resume_is_bit_identical_from_both_optimizers_exact_main_shards(runs):
    """fp32 params: megatron saves the reconstructed weights, the layer each bucket's exact
    main shard, the dense and the expert optimizer's under keys of their own (an older
    release let the expert buckets' shards replace the dense ones': the losses left the
    straight run at the second step after the resume)."""
    root, results = runs
    straight = train_log(root, "fp32")
    resumed = {**train_log(root, "fp32_first"), **train_log(root, "fp32_second")}
    assert [resumed[i] for i in range(1, FP32_STEPS + 1)] == [straight[i] for i in range(1, FP32_STEPS + 1)]
    for r in results:
        assert r["fp32_second"]["weights_sha256_per_step"] == r["fp32"]["weights_sha256_per_step"][SAVED_AT:]


def test_a_resume_with_another_expert_parallel_size_is_refused_naming_the_flag(runs):
    _, results = runs
    errors = {r["other_ep"] for r in results}
    assert len(errors) == 1 and None not in errors, errors
    error, = errors
    assert "expert-parallel size 2, this run has 1" in error and "--expert-model-parallel-size 2" in error, error
    assert "\n" not in error


@pytest.mark.parametrize("flags, named", [
    (["--expert-model-parallel-size", "2"], "add --num-experts"),
    (["--num-experts", "2", "--moe-router-topk", "3"], "--moe-router-topk 3"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], "--num-experts 3 is not divisible"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 1"),
])
def test_bad_expert_flags_are_refused_in_one_line(flags, named):
    from megatron_sdp4bit.training.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError) as error:
        parse_args(["--num-attention-heads", "4"] + flags)
    assert named in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_data_parallel_size_the_expert_parallel_size_does_not_divide_is_refused():
    from megatron_sdp4bit.training.arguments import ArgumentError, parse_args
    from megatron_sdp4bit.training.distributed import parallel_layout

    with pytest.raises(ArgumentError, match="data-parallel size 4 is not divisible by "
                                            "--expert-model-parallel-size 3"):
        parallel_layout(parse_args(["--num-experts", "3", "--expert-model-parallel-size", "3"]), 4)
