"""Resuming a checkpoint under another data-parallel size: 4 -> 2 and 2 -> 4 ranks.

Three spawned worlds, one after another, SDP4Bit on with fp32 params (so the
layer's exact main shards are saved too):

- 4 ranks: train 3 steps and save (A); continue A to 6 steps (the reference);
- 2 ranks: load A and save it at once (B); continue A to 6 steps; load A into a
  model of another shape (refused, in one line, before anything is loaded);
- 4 ranks: load B and save it at once (C).

The optimizer state (fp32 main weights, Adam moments) and the layer's main
shards assembled over the ranks must be bit-identical in A and B, and C must
equal A rank by rank. The layout check itself is tested on layouts (TP, PP,
dtypes, buckets, megatron-core version, SDP4Bit config).
"""
from __future__ import annotations

import os

import pytest
import torch

from driver_runs import TINY_GPT, captured_run, corpus_cache, driver_ranks, train_log
from megatron_sdp4bit.training.checkpoint import CheckpointError, compare_layouts

SAVED_AT, STEPS = 3, 6
TINY = TINY_GPT + ["--lr-decay-iters", str(STEPS), "--sdp4bit"]


def _world(rank, world_size, root, runs):
    out = {}
    for name, flags in runs:
        argv = TINY + ["--sdp4bit-ranks-per-node", str(max(1, world_size // 2)),
                       "--run-dir", os.path.join(root, name)] + flags
        out[name] = captured_run(argv)
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    ck = {k: os.path.join(root, k) for k in ("A", "B", "C")}
    with corpus_cache(root):
        four = driver_ranks(_world, 4, root, [
            ("first4", ["--train-iters", str(SAVED_AT), "--save", ck["A"]]),
            ("straight4", ["--train-iters", str(STEPS), "--load", ck["A"]]),
        ], timeout_s=300)
        two = driver_ranks(_world, 2, root, [
            ("to2", ["--train-iters", str(SAVED_AT), "--load", ck["A"], "--save", ck["B"]]),
            ("cont2", ["--train-iters", str(STEPS), "--load", ck["A"]]),
            ("other_model", ["--train-iters", str(STEPS), "--load", ck["A"], "--hidden-size", "64"]),
        ], timeout_s=300)
        back = driver_ranks(_world, 4, root, [
            ("back4", ["--train-iters", str(SAVED_AT), "--load", ck["B"], "--save", ck["C"]]),
        ], timeout_s=300)
    return root, ck, four, two, back


def _files(directory):
    path = os.path.join(directory, f"iter_{SAVED_AT:07d}")
    names = sorted(n for n in os.listdir(path) if n.startswith("rank_"))
    return [torch.load(os.path.join(path, n), map_location="cpu", weights_only=False) for n in names]


def _world_buckets(files):
    """Per (optimizer, buffer, bucket, key): the bucket's state over all ranks, unpadded."""
    out = {}
    for rank, state in enumerate(files):
        for o, param_state in enumerate(state["param_state"]):
            size = len(files)
            for g, per_dtype in param_state.items():
                if not isinstance(g, int):
                    continue
                for dtype, buckets in per_dtype.items():
                    for b, entries in enumerate(buckets):
                        n = param_state["per_bucket_numel"][g][dtype][b]
                        unpadded = param_state["per_bucket_numel_unpadded"][g][dtype][b]
                        for entry in entries:
                            start = rank * (n // size) + entry["gbuf_local_start"]
                            for key, value in entry.items():
                                if torch.is_tensor(value) and value.dim() == 1:
                                    full = out.setdefault((o, g, b, key), torch.full((unpadded,), float("nan")))
                                    full[start:start + value.numel()] = value
    return out


def _world_main_shards(files):
    out = {}
    for key in files[0]["extra"]["sdp4bit"]["main_shards"]:
        out[key] = torch.cat([f["extra"]["sdp4bit"]["main_shards"][key] for f in files])
    return out


def test_4_to_2_reshards_the_optimizer_and_layer_state_exactly(worlds):
    root, ck, four, two, _ = worlds
    assert two[0]["to2"]["error"] is None, two[0]["to2"]["error"]
    out = two[0]["to2"]["stdout"]
    assert "saved with data-parallel size 4, this run has 2: resharding the optimizer state" in out
    assert f"resumed from {ck['A']} at iteration {SAVED_AT}" in out
    a, b = _files(ck["A"]), _files(ck["B"])
    assert len(a) == 4 and len(b) == 2
    wa, wb = _world_buckets(a), _world_buckets(b)
    assert sorted(wa) == sorted(wb) and {k[3] for k in wa} >= {"param", "exp_avg", "exp_avg_sq"}
    for key in wa:
        held = ~torch.isnan(wa[key])  # params (not the gaps megatron aligns them with)
        assert held.float().mean() > 0.9 and torch.equal(held, ~torch.isnan(wb[key])), key
        assert torch.equal(wa[key][held], wb[key][held]), key
    ma, mb = _world_main_shards(a), _world_main_shards(b)
    assert ma, "fp32 params under qWD: the layer saves its exact main shards"
    for key in ma:
        n = min(ma[key].numel(), mb[key].numel())  # the end padding differs
        assert torch.equal(ma[key][:n], mb[key][:n]), key
    assert all(torch.equal(a[0]["model"][k], b[0]["model"][k]) for k in a[0]["model"] if torch.is_tensor(a[0]["model"][k]))
    for r in range(2):  # ranks 0 and 1 continue their own quantizer streams
        assert a[r]["extra"]["sdp4bit"]["rng"].keys() == b[r]["extra"]["sdp4bit"]["rng"].keys()


def test_2_to_4_gives_back_the_original_shards(worlds):
    _, ck, _, _, back = worlds
    assert back[0]["back4"]["error"] is None, back[0]["back4"]["error"]
    assert "saved with data-parallel size 2, this run has 4" in back[0]["back4"]["stdout"]
    a, c = _files(ck["A"]), _files(ck["C"])
    for ra, rc in zip(a, c):
        for pa, pc in zip(ra["param_state"], rc["param_state"]):
            assert pa["per_bucket_numel"] == pc["per_bucket_numel"]
            for g in (k for k in pa if isinstance(k, int)):
                for dtype in pa[g]:
                    for ea, ec in zip(pa[g][dtype], pc[g][dtype]):
                        assert len(ea) == len(ec)
                        for x, y in zip(ea, ec):
                            assert x.keys() == y.keys()
                            for key in x:
                                if torch.is_tensor(x[key]):
                                    assert torch.equal(x[key], y[key]), key
                                else:
                                    assert x[key] == y[key], key
        for key, shard in ra["extra"]["sdp4bit"]["main_shards"].items():
            assert torch.equal(shard, rc["extra"]["sdp4bit"]["main_shards"][key]), key


def test_the_resharded_run_continues_the_curve(worlds):
    root, ck, four, two, _ = worlds
    assert two[0]["cont2"]["error"] is None, two[0]["cont2"]["error"]
    straight, resharded = train_log(root, "straight4"), train_log(root, "cont2")
    assert sorted(resharded) == list(range(SAVED_AT + 1, STEPS + 1))
    # The first step's loss comes from the loaded weights: equal but for the order of
    # the sums. After that not bit for bit: 2 ranks sum and quantize the gradients
    # differently from 4 (here 8.92967 vs 8.92967, 8.88326 vs 8.88387, 8.80133 vs 8.80152).
    first = SAVED_AT + 1
    assert abs(resharded[first] - straight[first]) < 1e-6 * straight[first], (resharded, straight)
    for it in resharded:
        assert abs(resharded[it] - straight[it]) < 2e-3 * straight[it], (it, resharded[it], straight[it])


def test_a_different_model_is_refused_in_one_line_before_loading(worlds):
    _, ck, _, two, _ = worlds
    for rank_result in two:
        error = rank_result["other_model"]["error"]
        assert error is not None and "\n" not in error
        assert error == (f"checkpoint {ck['A']}/iter_{SAVED_AT:07d} was saved with --hidden-size 32 (this run: 64), "
                         "--ffn-hidden-size 128 (this run: 256): another model; resume with --hidden-size 32 "
                         "--ffn-hidden-size 128")
        assert "resumed" not in rank_result["other_model"]["stdout"]


# --- the layout check on its own ------------------------------------------------------------

LAYOUT = {"world_size": 4, "data_parallel_size": 4, "tensor_model_parallel_size": 1,
          "pipeline_model_parallel_size": 1, "megatron_core": "0.16.1",
          "sdp4bit": {"weight_mode": "diff", "grad_mode": "tlq-hs", "ranks_per_node": 2},
          "buckets": {"0": [[{"dtypes": ["float32", "float32"], "numel_unpadded": [1000]}]]},
          "bucket_size": None, "global_batch_size": 8}


def _with(**changes):
    return {**LAYOUT, **changes}


def test_layout_differences_are_refused_or_warned_in_one_line():
    d = "ck/iter_0000010"
    assert compare_layouts(d, LAYOUT, dict(LAYOUT)) == (False, [])
    assert compare_layouts(d, LAYOUT, _with(world_size=2, data_parallel_size=2,
                                            sdp4bit={**LAYOUT["sdp4bit"], "ranks_per_node": 1})) == (True, [])
    refusals = [
        (_with(tensor_model_parallel_size=2), "was saved with tensor-parallel size 1, this run has 2"),
        (_with(pipeline_model_parallel_size=2), "pipeline-parallel size 1, this run has 2"),
        (_with(buckets={"0": [[{"dtypes": ["bfloat16", "float32"], "numel_unpadded": [1000]}]]}), "--bf16"),
        (_with(buckets={"0": [[{"dtypes": ["float32", "float32"], "numel_unpadded": [600, 400]}]]},
               bucket_size=600), "without --overlap-grad-reduce"),
        (_with(data_parallel_size=2, tensor_model_parallel_size=2),
         "resharding is supported with TP = PP = EP = 1 only"),
        # 4 -> 2 ranks without --global-batch-size halves its default: refused, not a silent
        # change of the schedule and of where the data resumes (the rule of every data
        # setting, test_resume_data.py; a checkpoint of before the rule recorded it alone)
        (_with(world_size=2, data_parallel_size=2, data={"global_batch_size": 4}),
         "--global-batch-size 8 (this run: 4; without --global-batch-size it is --micro-batch-size x "
         "data-parallel size): this run would train on other samples than the run it continues; resume with "
         "--global-batch-size 8"),
    ]
    for current, message in refusals:
        with pytest.raises(CheckpointError) as info:
            compare_layouts(d, {**LAYOUT, "tensor_model_parallel_size": current["tensor_model_parallel_size"]}
                            if "resharding" in message else LAYOUT, current)
        assert message in str(info.value) and "\n" not in str(info.value)
        assert str(info.value).startswith(f"checkpoint {d} was saved with")
    with pytest.raises(CheckpointError, match=r"bucketing differ \(its DDP bucket size was 600: pass --bucket-size 600\)$"):
        compare_layouts(d, _with(buckets={"0": [[{"dtypes": ["float32", "float32"], "numel_unpadded": [600, 400]}]]},
                                 bucket_size=600), LAYOUT)
    reshard, warnings = compare_layouts(d, LAYOUT, _with(megatron_core="0.19.2",
                                                         sdp4bit={**LAYOUT["sdp4bit"], "weight_mode": "off"}))
    assert not reshard and len(warnings) == 2
    assert "megatron-core 0.16.1, this run has 0.19.2" in warnings[0]
    assert "weight_mode diff -> off" in warnings[1]
    # megatron-core 0.19 appends the working directory's git commit to its version: not a change
    assert compare_layouts(d, _with(megatron_core="0.19.2+3b25f53"), _with(megatron_core="0.19.2+9d19c73")) \
        == (False, [])
    # checkpoints written before the batch size was recorded load as before (the layout
    # of a run without a data record compares none)
    assert compare_layouts(d, _with(global_batch_size=None), LAYOUT) == (False, [])
    # another SDP4Bit seed: the rounding streams come from the checkpoint all the same
    _, (warning,) = compare_layouts(d, _with(sdp4bit={**LAYOUT["sdp4bit"], "seed": 1}),
                                    _with(sdp4bit={**LAYOUT["sdp4bit"], "seed": 5}))
    assert "(seed 1 -> 5)" in warning and warning.endswith("the rounding streams continue the checkpoint's: its "
                                                           "seed drew them)")
    # where the collectives ran is not the checkpoint's business: another --sdp4bit-runner,
    # or a checkpoint saved before the field existed, loads without a word
    without = {k: v for k, v in LAYOUT["sdp4bit"].items() if k != "runner"}
    for saved in ({**LAYOUT["sdp4bit"], "runner": "inline"}, without):
        assert compare_layouts(d, _with(sdp4bit=saved), _with(sdp4bit={**LAYOUT["sdp4bit"],
                                                                      "runner": "auto"})) == (False, [])


def test_each_pipeline_stage_is_compared_with_its_own_saved_buckets():
    stage = lambda n: [[{"dtypes": ["bfloat16", "float32"], "numel_unpadded": [n]}]]  # noqa: E731
    saved = _with(pipeline_model_parallel_size=2, buckets={"0": stage(102016), "1": stage(100096)})
    for key, numel in (("0", 102016), ("1", 100096)):
        current = _with(pipeline_model_parallel_size=2, buckets={key: stage(numel)})
        assert compare_layouts("ck", saved, current) == (False, [])
    with pytest.raises(CheckpointError, match="optimizer buckets of"):
        compare_layouts("ck", saved, _with(pipeline_model_parallel_size=2, buckets={"1": stage(102016)}))


def test_reshard_arithmetic_on_stand_ins():
    """4 -> 2 -> 3 ranks over a bucket of params at 64-aligned starts, padded per DP size,
    against the world tensors: what megatron's dist_checkpointing would assemble."""
    from megatron_sdp4bit.training.checkpoint.reshard import reshard_parameter_state

    key = (torch.float32, torch.float32)
    params = [(0, 100), (128, 300), (320, 321), (384, 1000)]  # [start, end) in the bucket
    unpadded = 1000
    world = {"param": torch.randn(unpadded), "exp_avg": torch.randn(unpadded),
             "exp_avg_sq": torch.rand(unpadded)}

    def padded(size):
        import math
        return -(-unpadded // math.lcm(size, 128)) * math.lcm(size, 128)

    def entries(rank, size):
        local = padded(size) // size
        out = []
        for start, end in params:
            lo, hi = max(start, rank * local), min(end, (rank + 1) * local)
            if lo < hi:
                out.append({**{k: v[lo:hi].clone() for k, v in world.items()},
                            "step": torch.tensor(3.0),
                            "gbuf_local_start": lo - rank * local, "gbuf_local_end": hi - rank * local})
        return out

    def state(rank, size):  # what the adapter's parameter_state_for_save returns on that rank
        return {"per_bucket_numel": [{key: [padded(size)]}], "per_bucket_numel_unpadded": [{key: [unpadded]}],
                0: {key: [entries(rank, size)]}}

    for old, new in ((4, 2), (2, 4), (4, 3), (1, 4)):
        saved = [state(k, old) for k in range(old)]
        for rank in range(new):
            got = reshard_parameter_state(state(rank, new), rank, new, lambda k: saved[k], old)
            want = entries(rank, new)
            assert got["per_bucket_numel"] == [{key: [padded(new)]}]
            assert len(got[0][key][0]) == len(want)
            for g, w in zip(got[0][key][0], want):
                assert g["padding"] is False and torch.equal(g["step"], w["step"])
                for k in ("param", "exp_avg", "exp_avg_sq", "gbuf_local_start", "gbuf_local_end"):
                    assert (torch.equal(g[k], w[k]) if torch.is_tensor(w[k]) else g[k] == w[k]), (old, new, k)
    with pytest.raises(ValueError, match="cannot be resharded"):
        reshard_parameter_state({**state(0, 2), "per_bucket_numel_unpadded": [{key: [999]}]}, 0, 2,
                                lambda k: saved[k], 4)


def test_the_preset_a_checkpoint_names_ignores_where_its_collectives_ran():
    from megatron_sdp4bit.config import preset
    from megatron_sdp4bit.training.checkpoint.run_layout import preset_name

    saved = preset("zeropp", runner="inline").to_dict()
    assert preset_name(saved) == "preset zeropp"
    assert preset_name({k: v for k, v in saved.items() if k != "runner"}) == "preset zeropp"
    assert preset_name(dict(saved, rounding="nearest")) == "a custom SDP4Bit config"
