"""scripts/reproduce_accuracy.py: resumable runs, the seed-by-seed analysis, bad input.

The driver runs themselves are what `make train` runs (tests/training covers the
driver); here the study's bookkeeping is checked with result files written the way
a finished run writes them.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from megatron_sdp4bit.jobs import Job

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "scripts")
sys.path.insert(0, SCRIPTS)
import reproduce_accuracy as study  # noqa: E402


def _write_result(out, config, seed, loss, fingerprint):
    curve = {"train": [[10, loss + 1], [20, loss + 0.5]], "valid": [[10, loss + 0.3], [20, loss]]}
    result = {"config": config, "seed": seed, "final_valid_loss": loss, "final_train_loss": loss,
              "curves": curve, "seconds": 1.0, "flags": [], "fingerprint": fingerprint,
              "commit": "x", "finished": "now"}
    os.makedirs(os.path.join(out, "results"), exist_ok=True)
    with open(os.path.join(out, "results", f"{config}-seed{seed}.json"), "w") as f:
        json.dump(result, f)


def _fingerprint():
    shared, _ = study.recipe_flags("cpu", 8, 4)
    return study.study_fingerprint(shared)


def test_finished_runs_are_skipped_and_the_rest_run(tmp_path, monkeypatch):
    fingerprint = _fingerprint()
    for seed in (1, 2):
        _write_result(str(tmp_path), "baseline", seed, 5.70 + seed / 100, fingerprint)
    ran = []

    def fake_run_one(out, config, seed, shared, ranks, fp, checkpoint_interval, timeout):
        # CPU runs take minutes: no checkpoints, and a hung one is stopped
        assert checkpoint_interval == 0 and timeout == study.CPU_RUN_TIMEOUT_S
        assert fp == fingerprint and ranks == 4
        ran.append((config, seed))
        _write_result(out, config, seed, 5.75, fp)
        return {"final_valid_loss": 5.75}

    monkeypatch.setattr(study, "run_one", fake_run_one)
    assert study.main(["--out", str(tmp_path), "--seeds", "1", "2", "--configs", "baseline",
                       "SDP4Bit"]) == 0
    assert ran == [("SDP4Bit", 1), ("SDP4Bit", 2)]  # the baseline runs were already finished
    ran.clear()
    assert study.main(["--out", str(tmp_path), "--seeds", "1", "2", "--configs", "baseline",
                       "SDP4Bit"]) == 0
    assert ran == []  # everything finished: nothing reruns
    assert (tmp_path / "table.md").read_text().count("| SDP4Bit |") == 1


def test_max_runs_bounds_one_sitting(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(study, "run_one", lambda out, c, s, *a, **k: ran.append((c, s)) or
                        {"final_valid_loss": 1.0})
    study.main(["--out", str(tmp_path), "--seeds", "1", "2", "3", "--max-runs", "2"])
    assert ran == [("baseline", 1), ("qW", 1)]


def test_results_of_another_recipe_are_refused(tmp_path):
    _write_result(str(tmp_path), "baseline", 1, 5.7, "someotherrecipe")
    with pytest.raises(SystemExit, match="other flags"):
        study.main(["--out", str(tmp_path), "--analyze"])


def test_summary_pairs_seeds_and_flags_differences_beyond_the_spread():
    results = {}
    for seed, noise in ((1, 0.00), (2, 0.02), (3, -0.02)):
        base = 5.70 + noise  # the seeds move every configuration alike
        for config, shift in (("baseline", 0.0), ("qW", 0.10), ("SDP4Bit", 0.001 * (seed - 2))):
            results[(config, seed)] = {"final_valid_loss": base + shift}
    summary = study.summarize(results)
    assert summary["qW"]["exceeds_seed_spread"] is True
    assert summary["qW"]["vs_baseline_pct"] == pytest.approx(100 * 0.10 / 5.70, rel=1e-6)
    assert summary["SDP4Bit"]["exceeds_seed_spread"] is False
    assert summary["baseline"]["std"] == pytest.approx(0.02)
    assert summary["SDP4Bit"]["paper_vs_baseline_pct"] == pytest.approx(100 * (2.29590 / 2.29392 - 1))
    text = study.table(summary)
    assert "| qW | 2.57312 | +12.17% |" in text and "| yes |" in text


def test_analysis_writes_the_validation_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the figure needs matplotlib: pip install -e .[plots] (make test installs it)")
    fingerprint = _fingerprint()
    for seed in (1, 2):
        _write_result(str(tmp_path), "baseline", seed, 5.70, fingerprint)
        _write_result(str(tmp_path), "SDP4Bit", seed, 5.71, fingerprint)
    study.main(["--out", str(tmp_path), "--analyze"])
    png = capsys.readouterr().out.split("curves: ")[1].strip()
    assert png.startswith(str(tmp_path)) and png.endswith(".png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _sampled_train_records(run_dir, crest_p99):
    """A quantized run's metrics: logged steps 10 and 20, the group shape sampled on both."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for iteration, scale in ((10, 1.0), (20, 2.0)):
            f.write(json.dumps({"kind": "train", "iteration": iteration, "loss": 6.0,
                                "grad_crest_median": 2.8 * scale, "grad_crest_p99": crest_p99 * scale,
                                "grad_crest_share_above_8": 0.01 * scale,
                                "grad_4bit_error_tlq": 0.2 * scale,
                                "grad_4bit_error_tlq_hs": 0.16}) + "\n")
        f.write(json.dumps({"kind": "valid", "iteration": 20, "loss": 6.5}) + "\n")


def test_the_table_shows_the_gradient_groups_the_quantized_runs_sampled(tmp_path, monkeypatch, capsys):
    """The runs that quantize gradients report their 4-bit groups' crest factors and the
    error without / with the rotation (second half of training, mean over seeds); the
    baseline, which quantizes nothing, has no row. A result written before results kept
    the figures takes them from its run's metrics."""
    fingerprint = _fingerprint()
    out = str(tmp_path)
    monkeypatch.setattr(study, "plot", lambda *a: None)
    _write_result(out, "baseline", 1, 5.70, fingerprint)
    for seed, p99 in ((1, 5.0), (2, 7.0)):
        _write_result(out, "TLq", seed, 5.72, fingerprint)
        _sampled_train_records(os.path.join(out, "runs", f"TLq-seed{seed}"), p99)
    study.main(["--out", out, "--analyze"])
    text = capsys.readouterr().out
    # step 20 only (the second half of 20 steps): p99 2 x mean(5, 7) = 12, share 2%
    assert "| TLq | 2 | 5.60 | 12.00 | 2.00% | 0.400 | 0.160 |" in text, text
    assert "| baseline | 1 |" not in text.split("4-bit gradient groups")[1]


def test_gpu_recipe_needs_data(capsys):
    with pytest.raises(SystemExit):
        study.parse_args(["--recipe", "gpu-125m"])
    assert "--data-path" in capsys.readouterr().err


def _fake_driver(monkeypatch, calls):
    """run_driver stand-in: records the flags and timeout, writes a finished run's metrics."""
    def fake(flags, log_path, ranks, timeout, cwd):
        calls.append((list(flags), timeout))
        run_dir = flags[flags.index("--run-dir") + 1]
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"kind": "train", "iteration": 10, "loss": 6.0}) + "\n")
            f.write(json.dumps({"kind": "valid", "iteration": 10, "loss": 6.5}) + "\n")
        assert cwd == study.ROOT  # as from the checkout
        return Job(0, 1.0, log_path)

    monkeypatch.setattr(study, "run_driver", fake)


def test_gpu_runs_checkpoint_and_resume_and_have_no_time_limit(tmp_path, monkeypatch):
    """A GPU run takes many hours: an interrupted one resumes from its checkpoints
    (kept until the run has finished), and no timeout stops it."""
    calls = []
    _fake_driver(monkeypatch, calls)
    out = str(tmp_path)
    checkpoints = os.path.join(out, "checkpoints", "SDP4Bit-seed2")
    os.makedirs(checkpoints)  # left by an interrupted attempt
    result = study.run_one(out, "SDP4Bit", 2, ["--x"], 8, "fp", checkpoint_interval=500,
                           timeout=None)
    flags, timeout = calls[0]
    assert timeout is None
    assert flags[flags.index("--save") + 1] == flags[flags.index("--load") + 1] == checkpoints
    assert flags[flags.index("--save-interval") + 1] == "500"
    assert result["final_valid_loss"] == 6.5 and not os.path.exists(checkpoints)


def test_cpu_runs_start_again_and_are_time_limited(tmp_path, monkeypatch):
    calls = []
    _fake_driver(monkeypatch, calls)
    out = str(tmp_path)
    stale = os.path.join(out, "runs", "qW-seed1")
    os.makedirs(stale)
    with open(os.path.join(stale, "metrics.jsonl"), "w") as f:  # an unfinished attempt's
        f.write(json.dumps({"kind": "valid", "iteration": 5, "loss": 9.0}) + "\n")
    result = study.run_one(out, "qW", 1, ["--x"], 4, "fp")
    flags, timeout = calls[0]
    assert "--save" not in flags and "--load" not in flags
    assert timeout == study.CPU_RUN_TIMEOUT_S
    assert result["curves"]["valid"] == [[10, 6.5]]  # nothing of the old attempt


def test_the_outlier_recipe_is_a_cpu_recipe_with_its_own_flags(tmp_path, monkeypatch):
    """``--recipe cpu-outliers`` needs no data, runs time-limited without checkpoints,
    on make train's model at lr 1e-2, and its results are not mixed with the default
    recipe's (another fingerprint)."""
    calls = []
    _fake_driver(monkeypatch, calls)
    monkeypatch.setattr(study, "analyze", lambda *a: {})
    out = str(tmp_path)
    assert study.main(["--recipe", "cpu-outliers", "--configs", "TLq", "--seeds", "1",
                       "--out", out]) == 0
    (flags, timeout), = calls
    assert flags[flags.index("--hidden-size") + 1] == "256" and flags[flags.index("--lr") + 1] == "1e-2"
    assert "--save" not in flags and timeout == study.CPU_RUN_TIMEOUT_S
    default, _ = study.recipe_flags("cpu", 8, 4)
    with pytest.raises(SystemExit, match="other flags"):
        study.load_results(out, study.study_fingerprint(default))


def test_the_table_says_when_its_runs_span_commits_that_change_the_arithmetic(tmp_path, monkeypatch):
    """Runs of a study made before and after a change to the quantizers cannot pass for
    one measurement: the table names the change."""
    fingerprint = _fingerprint()
    for seed, commit, finished in ((1, "a" * 40, "2026-12-01 10:00:00"),
                                   (2, "b" * 40, "2026-12-04 10:00:00")):
        _write_result(str(tmp_path), "baseline", seed, 5.70, fingerprint)
        path = tmp_path / "results" / f"baseline-seed{seed}.json"
        result = json.loads(path.read_text())
        result.update(commit=commit, dirty=False, finished=finished)
        path.write_text(json.dumps(result))
    monkeypatch.setattr(study, "git_changes_arithmetic", lambda root: lambda older, newer: True)
    study.main(["--out", str(tmp_path), "--analyze"])
    table = (tmp_path / "table.md").read_text()
    assert "Runs span 2 commits" in table and "aaaaaaa..bbbbbbb" in table


def test_a_run_records_its_commit_and_whether_the_tree_was_dirty(tmp_path, monkeypatch):
    _fake_driver(monkeypatch, [])
    monkeypatch.setattr(study, "run_commit", lambda root: {"commit": "c" * 40, "dirty": True})
    result = study.run_one(str(tmp_path), "qW", 1, ["--x"], 4, "fp")
    assert result["commit"] == "c" * 40 and result["dirty"] is True


def test_a_run_records_the_commit_it_started_on_and_a_change_meanwhile(tmp_path, monkeypatch):
    """The driver imports the code at its start: a commit made while it runs is not
    the one it ran on (before, the commit at its end was recorded), and a run whose
    checkout changed under it may have mixed both: marked dirty."""
    _fake_driver(monkeypatch, [])
    states = iter([{"commit": "a" * 40, "dirty": False}, {"commit": "a" * 40, "dirty": False},
                   {"commit": "a" * 40, "dirty": False}, {"commit": "b" * 40, "dirty": False}])
    monkeypatch.setattr(study, "run_commit", lambda root: next(states))
    steady = study.run_one(str(tmp_path), "qW", 1, ["--x"], 4, "fp")
    assert steady["commit"] == "a" * 40 and steady["dirty"] is False
    moved = study.run_one(str(tmp_path), "qW", 2, ["--x"], 4, "fp")
    assert moved["commit"] == "a" * 40 and moved["dirty"] is True
