"""Damaged checkpoints are found before anything is loaded, and named.

On files alone (one process): the manifest catches a truncated, changed or
missing rank file and an unreadable manifest; a damaged latest checkpoint is an
error that names the bad file and offers the newest earlier complete checkpoint,
which ``fallback=True`` loads instead.

Through the driver (2 gloo ranks): train 4 steps saving at 2 and 4, truncate one
rank file of iteration 4 (the issue's case: torch's traceback after rank 0 had
printed "resumed ... at iteration 4"); ``--load`` then stops on every rank with
the file named and no "resumed", and ``--load --load-fallback`` resumes from
iteration 2, saying so. Without the manifest (an older save), the truncated
file is named by the rank that reads it, and no rank resumes.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from driver_runs import TINY_GPT, captured_run, driver_world, train_log
from megatron_sdp4bit.training import checkpoint
from megatron_sdp4bit.training.checkpoint import LATEST, MANIFEST, CheckpointError


def _fake_checkpoint(root, iteration, payloads=(b"rank zero " * 100, b"rank one " * 100)):
    directory = root / f"iter_{iteration:07d}"
    directory.mkdir(parents=True)
    entries = []
    for rank, payload in enumerate(payloads):
        path = directory / f"rank_{rank:05d}.pt"
        path.write_bytes(payload)
        entries.append((path.name, *checkpoint.file_digest(str(path))))
    checkpoint.write_manifest(str(directory), iteration, {"world_size": len(payloads)}, entries)
    (root / LATEST).write_text(f"{iteration}\n")
    return directory


def test_the_manifest_names_each_damaged_file(tmp_path):
    directory = _fake_checkpoint(tmp_path, 4)
    manifest = checkpoint.read_manifest(str(directory))
    assert checkpoint.check_files(str(directory), manifest) == []
    one = directory / "rank_00001.pt"
    good = one.read_bytes()
    one.write_bytes(good[:500])
    assert checkpoint.check_files(str(directory), manifest) == [
        "rank_00001.pt is 500 bytes, the manifest says 900 (truncated)"]
    one.write_bytes(good[:-1] + b"X")
    [problem] = checkpoint.check_files(str(directory), manifest)
    assert problem.startswith("rank_00001.pt has SHA-256 ") and problem.endswith("(its contents changed)")
    one.unlink()
    assert checkpoint.check_files(str(directory), manifest) == ["rank_00001.pt is missing"]
    assert checkpoint.check_files(str(directory), manifest, share=0, shares=2) == []  # rank 0's share
    (directory / MANIFEST).write_text('{"files": {"rank_00000.pt": ')
    with pytest.raises(CheckpointError, match=r"^manifest.json is unreadable \("):
        checkpoint.read_manifest(str(directory))


def test_a_damaged_latest_checkpoint_offers_the_previous_complete_one(tmp_path, capsys):
    _fake_checkpoint(tmp_path, 2)
    damaged = _fake_checkpoint(tmp_path, 6)
    (tmp_path / "iter_0000004.tmp").mkdir()  # a save that never finished: not offered
    (damaged / "rank_00001.pt").write_bytes(b"rank one")
    with pytest.raises(CheckpointError) as info:
        checkpoint.choose_checkpoint(str(tmp_path), fallback=False)
    assert str(info.value) == (
        f"checkpoint {damaged} is damaged: rank_00001.pt is 8 bytes, the manifest says 900 "
        f"(truncated). The previous complete checkpoint is {tmp_path / 'iter_0000002'} (iteration 2): "
        "rerun with --load-fallback to resume from it")
    directory, manifest, passed_over = checkpoint.choose_checkpoint(str(tmp_path), fallback=True)
    assert directory == str(tmp_path / "iter_0000002") and manifest["iteration"] == 2
    assert passed_over == [6]
    out = capsys.readouterr().out
    assert out.startswith(f"--load-fallback: checkpoint {damaged} is damaged: rank_00001.pt is 8 bytes")
    assert out.strip().endswith(f"loading the previous complete checkpoint, {directory} (iteration 2)")
    (tmp_path / "iter_0000002" / "rank_00000.pt").write_bytes(b"")  # now both are damaged
    for fallback in (False, True):
        with pytest.raises(CheckpointError, match="There is no earlier complete checkpoint in"):
            checkpoint.choose_checkpoint(str(tmp_path), fallback=fallback)
    (tmp_path / LATEST).write_text("garbage\n")
    with pytest.raises(CheckpointError, match="holds 'garbage', not an iteration number"):
        checkpoint.choose_checkpoint(str(tmp_path), fallback=False)


# --- through the driver ----------------------------------------------------------------------

TINY = TINY_GPT + ["--lr-decay-iters", "6", "--bf16",
                   "--sdp4bit", "--sdp4bit-ranks-per-node", "1"]


def _world(rank, world_size, root):
    import torch

    ckpt = os.path.join(root, "ckpt")

    def go(name, flags):
        return captured_run(TINY + ["--run-dir", os.path.join(root, name)] + flags)

    out = {"train": go("train", ["--train-iters", "4", "--save", ckpt, "--save-interval", "2"])}
    if rank == 0:  # a copy cut short, as a full disk or a killed copy leaves it
        path = os.path.join(ckpt, "iter_0000004", "rank_00001.pt")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    torch.distributed.barrier()
    out["load"] = go("load", ["--train-iters", "6", "--load", ckpt])
    out["fallback"] = go("fallback", ["--train-iters", "6", "--load", ckpt, "--load-fallback"])
    old = os.path.join(root, "old_ckpt")
    if rank == 0:  # as a checkpoint saved before manifests existed would be
        shutil.copytree(ckpt, old)
        os.remove(os.path.join(old, "iter_0000004", MANIFEST))
    torch.distributed.barrier()
    out["unverified"] = go("unverified", ["--train-iters", "6", "--load", old])
    return out


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return driver_world(tmp_path_factory, "verify", _world, 2, timeout_s=300)


def test_saves_write_a_manifest_of_the_layout_and_files(driver):
    root, results = driver
    assert results[0]["train"]["error"] is None
    for iteration in (2, 4):
        with open(os.path.join(root, "ckpt", f"iter_{iteration:07d}", MANIFEST)) as f:
            manifest = json.load(f)
        assert manifest["iteration"] == iteration
        assert sorted(manifest["files"]) == ["rank_00000.pt", "rank_00001.pt"]
        layout = manifest["layout"]
        assert (layout["world_size"], layout["data_parallel_size"], layout["tensor_model_parallel_size"],
                layout["pipeline_model_parallel_size"]) == (2, 2, 1, 1)
        assert layout["sdp4bit"]["weight_mode"] == "diff" and layout["megatron_core"]
        buckets = layout["buckets"]
        buckets = buckets["0"] if isinstance(buckets, dict) else buckets  # per pipeline stage
        assert buckets[0][0]["dtypes"] == ["bfloat16", "float32"]


def test_a_truncated_file_stops_every_rank_before_any_resume(driver):
    root, results = driver
    damaged = os.path.join(root, "ckpt", "iter_0000004")
    for result in results:
        assert result["load"]["error"] == (
            f"checkpoint {damaged} is damaged: rank_00001.pt is "
            f"{os.path.getsize(os.path.join(damaged, 'rank_00001.pt'))} bytes, the manifest says "
            f"{json.load(open(os.path.join(damaged, MANIFEST)))['files']['rank_00001.pt']['bytes']} "
            f"(truncated). The previous complete checkpoint is {os.path.join(root, 'ckpt', 'iter_0000002')} "
            "(iteration 2): rerun with --load-fallback to resume from it")
        assert "resumed" not in result["load"]["stdout"]
        assert " iter " not in result["load"]["stdout"] and "iter      " not in result["load"]["stdout"]


def test_load_fallback_resumes_from_the_previous_complete_checkpoint(driver):
    root, results = driver
    out = results[0]["fallback"]["stdout"]
    assert results[0]["fallback"]["error"] is None, results[0]["fallback"]["error"]
    assert (f"--load-fallback: checkpoint {os.path.join(root, 'ckpt', 'iter_0000004')} is damaged: "
            "rank_00001.pt is ") in out
    assert f"loading the previous complete checkpoint, {os.path.join(root, 'ckpt', 'iter_0000002')}" in out
    assert f"resumed from {os.path.join(root, 'ckpt')} at iteration 2" in out
    losses, trained = train_log(root, "fallback"), train_log(root, "train")
    assert sorted(losses) == [3, 4, 5, 6]
    assert [losses[3], losses[4]] == [trained[3], trained[4]]  # the same steps again, bit for bit


def test_an_unreadable_file_without_a_manifest_stops_every_rank_too(driver):
    root, results = driver
    path = os.path.join(root, "old_ckpt", "iter_0000004", "rank_00001.pt")
    assert results[1]["unverified"]["error"].startswith(
        f"{path} is unreadable, the checkpoint is damaged (")
    assert results[0]["unverified"]["error"].startswith(
        f"loading {os.path.dirname(path)} failed on rank 1: {path} is unreadable")
    assert "has no manifest.json (saved by an older version)" in results[0]["unverified"]["stdout"]
    for result in results:
        assert "resumed" not in result["unverified"]["stdout"]


@pytest.mark.parametrize("layout, found", [("mp_rank_00/model_optim_rng.pt", "torch"), ("__0_0.distcp", "torch_dist")])
def test_a_megatron_lm_checkpoint_is_named_as_such(tmp_path, layout, found):
    """Before: 'checkpoint .../iter_0000010 is damaged: it has neither manifest.json nor
    rank_00000.pt. There is no earlier complete checkpoint in ...'."""
    path = tmp_path / "iter_0000010" / layout
    path.parent.mkdir(parents=True)
    path.write_bytes(b"megatron-lm")
    (tmp_path / LATEST).write_text("10\n")
    with pytest.raises(CheckpointError) as info:
        checkpoint.choose_checkpoint(str(tmp_path), fallback=True)
    assert str(info.value) == (
        f"checkpoint {tmp_path / 'iter_0000010'} is Megatron-LM's ({found} format), which this driver does not "
        "read (its own are rank_NNNNN.pt files and manifest.json): resume it with Megatron-LM and SDP4Bit's flags "
        "(python -m megatron_sdp4bit.launch PATH/TO/pretrain_gpt.py ... --sdp4bit), or drop --load to start this "
        "driver from scratch")
