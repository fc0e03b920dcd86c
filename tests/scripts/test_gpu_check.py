"""scripts/gpu_check.sh cannot rot: its CPU self-test runs every step's logic here.

The GPU machine is lent rarely and briefly, so a check that breaks there costs a
whole lease. ``--cpu-smoke`` runs the same steps on CPU with tiny sizes (Triton in
its interpreter, the collectives and the driver at DP=4 on 4 CPU ranks, the
driver for 4 iterations of a 2-layer model with two presets); the other tests cover the parts that differ on a GPU machine: missing
packages, the Megatron-LM step's skip reasons, failures and the time budget.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
LINE = re.compile(r"^\[(PASS|FAIL|SKIP)\] (\S+) \(\d+ s\)", re.M)


def _load_steps():
    spec = importlib.util.spec_from_file_location(
        "gpu_check_steps", os.path.join(ROOT, "scripts", "gpu_check_steps.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


steps = _load_steps()


def _env(tmp_path, **changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM_PATH", "OUT")}
    env.update(PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               GPU_CHECK_CORPUS=str(tmp_path / "no-carried-corpus"))  # build a tiny one
    env.update(changes)
    return env


def _statuses(stdout: str) -> dict:
    return {name: status for status, name in LINE.findall(stdout)}


def _carried_megatron_core() -> str:
    """The megatron-core release the GPU check carries to the GPU machine (which has none):
    ``scripts/gpu_check_prepare.sh``'s pin."""
    with open(os.path.join(ROOT, "scripts", "gpu_check_prepare.sh")) as f:
        return re.search(r'^mcore="megatron-core==([0-9.]+)"', f.read(), re.M).group(1)


def _megatron_core_here() -> str:
    from importlib.metadata import version

    return version("megatron-core")


@pytest.mark.slow
@pytest.mark.skipif(_megatron_core_here() != _carried_megatron_core(),
                    reason="the GPU check runs on the megatron-core it carries "
                           f"({_carried_megatron_core()}, scripts/gpu_check_prepare.sh): its CPU self-test "
                           "runs against that release, in `make test`")
def test_cpu_smoke_runs_every_step_and_writes_the_results(tmp_path):
    result = subprocess.run(["bash", SCRIPT, "--cpu-smoke", "--work", str(tmp_path / "work")],
                            cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                            timeout=600)  # ~160 s alone on 2 cores; room for a slower machine
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    got = _statuses(result.stdout)
    expected = {name: "PASS" for name in (
        "env", "triton.compile", "triton.tests", "triton.dispatch", "large", "bench",
        "dp4.collectives", "dp4.collectives.deferred", "dp4.train.sdp4bit", "dp4.train.baseline",
        "dp4.loss", "hosts.moe.train", "hosts.moe", "train.sdp4bit", "train.baseline")}
    expected.update({"train.ratio": "SKIP", "megatron_lm": "SKIP", "overlap": "SKIP",
                     "nccl.collectives": "SKIP", "dp4.collectives.stream": "SKIP"})
    assert got == expected, result.stdout[-6000:]
    assert "SUMMARY: 15 PASS, 0 FAIL, 5 SKIP -> PASS" in result.stdout
    # the hosts step: 2 emulated hosts learned without --sdp4bit-ranks-per-node, experts
    assert "-m megatron_sdp4bit.emulated_hosts --hosts 2 --ranks-per-host 2" in result.stdout
    assert re.search(r"\[PASS\] hosts\.moe \(\d+ s\): 2 nodes learned from the hosts.*"
                     r"\d\.\d{3}x of the exact bytes \(dense dp4 run \d\.\d{3}\)", result.stdout)
    # the overlap step's machinery ran: a profile, a share (the target is a GPU's)
    assert re.search(r"\[SKIP\] overlap \(\d+ s\): \d+\.\d% of the quantization cpu threads time",
                     result.stdout), result.stdout[-6000:]
    assert "--overlap-grad-reduce --overlap-param-gather --bucket-size" in result.stdout  # dp4
    # SDP4Bit's dp4 run on the runner the flag names (stream on a GPU, deferred here), said
    assert re.search(r"\[PASS\] dp4\.loss \(\d+ s\): final loss sdp4bit \d+\.\d{4} \(deferred runner\)",
                     result.stdout), result.stdout[-6000:]
    assert re.search(r"sdp4bit / baseline = \d+\.\d{4}", result.stdout)  # the side-by-side ratio
    assert "MEGATRON_LM_PATH is not set" in result.stdout

    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert all((out / name).is_file() for name in files)  # nothing nested: the device returns files
    assert len(files) <= 8, files  # the device tool returns at most 8
    assert {"gpu_check.log", "gpu_check.json", "train-sdp4bit.jsonl", "train-baseline.jsonl",
            "dp4-sdp4bit.jsonl", "dp4-baseline.jsonl", "device_collectives.json"} <= set(files)
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-smoke" and report["result"] == "PASS" and report["failed"] == []
    assert {r["name"]: r["status"] for r in report["steps"]} == expected
    env = report["environment"]
    assert env["megatron_core"]["present"] and env["torch"]
    assert set(env["optional"]) == {"Apex", "Transformer Engine"}
    for name, probe in env["optional"].items():  # reported either way; absent here, usually
        assert probe["present"] == (importlib.util.find_spec(steps.OPTIONAL[name][1]) is not None)
    ratio = [r for r in report["steps"] if r["name"] == "train.ratio"][0]
    assert ratio["ratio"] > 0
    profile = [r for r in report["steps"] if r["name"] == "overlap"][0]
    assert 0 <= profile["share"] <= 1 and profile["intervals"] > 0
    log = (out / "gpu_check.log").read_text()
    assert "SUMMARY:" in log and "[PASS] dp4.loss" in log
    collectives = json.loads((out / "device_collectives.json").read_text())
    assert collectives["world"] == 4 and collectives["cases"]
    assert all(case["passed"] for case in collectives["cases"])
    assert {case["collective"] for case in collectives["cases"]} == {"reduce_scatter", "all_gather"}


def test_probe_reports_missing_and_broken_packages_without_crashing(tmp_path, monkeypatch):
    assert steps.probe_package("no-such-dist", "no_such_module_sdp4bit") == {
        "present": False, "version": None}
    broken = tmp_path / "brokenparent_sdp4bit"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('half installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = steps.probe_package("brokenparent", "brokenparent_sdp4bit.sub")
    assert probe["present"] is False and "half installed" in probe["error"]
    present = steps.probe_package("no-such-dist", "brokenparent_sdp4bit")  # found, no metadata
    assert present == {"present": True, "version": "unknown"}


def test_env_step_reports_absent_packages(monkeypatch, capsys):
    monkeypatch.setattr(steps.importlib, "import_module", lambda name, *args: None)  # fast: no megatron
    monkeypatch.setattr(steps, "OPTIONAL", {"Apex": ("apex", "no_such_apex_sdp4bit"),
                                            "Transformer Engine": ("te", "no_such_te_sdp4bit")})
    report = steps.Report()
    ctx = dict(smoke=True, env={})
    steps.step_env(report, ctx)
    assert report.results[0]["status"] == "PASS"
    assert "Apex absent, Transformer Engine absent" in report.results[0]["detail"]
    assert ctx["env"]["optional"]["Apex"] == {"present": False, "version": None}

    monkeypatch.setattr(steps, "probe_package", lambda dist, module: {"present": False, "version": None})
    report = steps.Report()
    steps.step_env(report, dict(smoke=True, env={}))
    assert report.results[0]["status"] == "FAIL"
    assert "megatron-core is missing" in report.results[0]["detail"]
    assert "[FAIL] env" in capsys.readouterr().out


def test_a_megatron_core_that_does_not_import_is_reported(monkeypatch):
    real_import = steps.importlib.import_module

    def broken(name, *args):
        if name == "megatron.core":
            raise ImportError("libsomething.so: cannot open shared object file")
        return real_import(name, *args)

    monkeypatch.setattr(steps.importlib, "import_module", broken)
    report = steps.Report()
    ctx = dict(smoke=True, env={})
    steps.step_env(report, ctx)
    assert report.results[0]["status"] == "FAIL"
    assert "import fails: ImportError: libsomething.so" in report.results[0]["detail"]
    assert ctx["env"]["megatron_core"]["present"] is False


def test_without_megatron_core_the_training_step_skips(tmp_path):
    report = steps.Report()
    ctx = dict(smoke=True, env={"megatron_core": {"present": False}}, work=str(tmp_path),
               out=str(tmp_path))
    steps.step_train(report, ctx)
    steps.step_dp4(report, ctx)
    steps.step_hosts(report, ctx)
    assert {r["name"]: r["status"] for r in report.results} == {
        "train.sdp4bit": "SKIP", "train.baseline": "SKIP", "dp4.collectives": "SKIP",
        "dp4.collectives.deferred": "SKIP", "dp4.collectives.stream": "SKIP",
        "dp4.train.sdp4bit": "SKIP", "dp4.train.baseline": "SKIP", "hosts.moe": "SKIP"}


def test_on_a_gpu_the_dp4_step_checks_the_stream_runner_over_gloo(tmp_path, monkeypatch):
    """One GPU cannot host two NCCL ranks: the runner the layer takes on NCCL (a side
    stream) is checked on the dp4 gloo ranks instead, after the layer's own and the deferred
    runner (the commands, not run here; the CPU self-test says why it skips it)."""
    seen = []
    monkeypatch.setattr(steps, "collectives_check", lambda *args, **env: seen.append(args + (env,)))
    ctx = dict(smoke=False, work=str(tmp_path), out=str(tmp_path))
    steps.dp4_collectives(steps.Report(), ctx, steps.GPU_DP4)
    assert [args[2] for args in seen] == list(steps.DP4_COLLECTIVES)
    (_, _, _, layer, _, _, _), _, (_, _, _, stream, stream_json, limit, env) = seen
    assert "--runner" not in layer
    assert stream[stream.index("--runner") + 1] == "stream"
    for flag, value in (("--device", "cuda"), ("--backend", "gloo"), ("--levels", "2"),
                        ("--shard", str(steps.STREAM_SHARD)), ("--json", stream_json)):
        assert stream[stream.index(flag) + 1] == value, flag
    assert stream.count("--shard") == 1 and stream_json.startswith(str(tmp_path))
    assert limit <= 90 and env == {}
    report = steps.Report()
    steps.dp4_collectives(report, dict(ctx, smoke=True), steps.CPU_DP4)
    assert report.results[-1]["name"] == "dp4.collectives.stream"
    assert report.results[-1]["status"] == "SKIP" and "CUDA stream" in report.results[-1]["detail"]


def test_the_hosts_verdict_wants_the_plan_lines_both_optimizers_checked_and_dense_bytes():
    output = "\n".join(steps.HOSTS_PLAN_LINES) + "\nreplica checks      8 passed (every 1 steps)\n"
    row = dict(bytes_sent=24, bytes_exact=100)
    status, detail = steps.hosts_verdict(output, row, 4, dense_ratio=0.22)
    assert status == "PASS" and "0.240x of the exact bytes (dense dp4 run 0.220)" in detail
    status, detail = steps.hosts_verdict(output, row, 4, dense_ratio=None)  # nothing to compare with
    assert status == "SKIP" and "not compared" in detail
    status, detail = steps.hosts_verdict(output, row, 4, dense_ratio=0.18)
    assert status == "FAIL" and "bytes ratio 0.240 vs the dense run's 0.180" in detail
    status, detail = steps.hosts_verdict(output.replace("8 passed", "4 passed"), row, 4, 0.22)
    assert status == "FAIL" and "replica checks 4, expected 8" in detail
    one_host = output.replace("2 hosts x 2 ranks", "1 host x 4 ranks")
    status, detail = steps.hosts_verdict(one_host, row, 4, 0.22)
    assert status == "FAIL" and "no line 'sdp4bit nodes: 2 hosts x 2 ranks (from the hosts)'" in detail


def test_the_nccl_step_runs_only_with_two_or_more_gpus(tmp_path, monkeypatch):
    """Below 2 GPUs (and in the CPU self-test) a SKIP that says why; with 2, one NCCL rank
    per GPU through device_collectives --backend nccl (the command, not run here)."""
    report = steps.Report()
    for smoke, gpus in ((True, 8), (False, 0), (False, 1)):
        steps.step_nccl(report, dict(smoke=smoke, env={"gpus": gpus}, work=str(tmp_path)))
    assert [r["status"] for r in report.results] == ["SKIP"] * 3
    assert "CPU self-test" in report.results[0]["detail"]
    assert report.results[2]["detail"].startswith("1 GPU visible: NCCL needs 2 or more")
    seen = []
    monkeypatch.setattr(steps, "collectives_check", lambda *args, **env: seen.append(args + (env,)))
    ctx = dict(smoke=False, env={"gpus": 2}, work=str(tmp_path), out=str(tmp_path))
    steps.step_nccl(report, ctx)
    (_, _, name, cmd, _, _, env), (_, _, deferred, deferred_cmd, deferred_json, _, deferred_env) = seen
    assert env == {}
    assert name == "nccl.collectives" and "--nproc-per-node=2" in cmd
    assert cmd[cmd.index("--backend") + 1] == "nccl"
    # then the one-hardware-queue runner, under the setting that selects it in training
    assert deferred == "nccl.collectives.deferred"
    assert deferred_cmd[deferred_cmd.index("--runner") + 1] == "deferred"
    assert deferred_cmd[deferred_cmd.index("--json") + 1] == deferred_json
    assert deferred_cmd[deferred_cmd.index("--backend") + 1] == "nccl"
    assert deferred_env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_megatron_lm_step_says_why_it_skips(tmp_path, monkeypatch):
    ctx = dict(smoke=False, work=str(tmp_path), deadline=0)
    cases = []
    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    cases.append("MEGATRON_LM_PATH is not set")
    tree = tmp_path / "Megatron-LM"
    tree.mkdir()
    monkeypatch.setenv("MEGATRON_LM_PATH", str(tree))
    report = steps.Report()
    steps.step_megatron_lm(report, ctx)
    (tree / "pretrain_gpt.py").write_text("")
    (tree / "megatron" / "core").mkdir(parents=True)
    (tree / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 15\nPATCH = 2\n")
    steps.step_megatron_lm(report, ctx)
    assert [r["status"] for r in report.results] == ["SKIP", "SKIP"]
    assert "has no pretrain_gpt.py" in report.results[0]["detail"]
    assert "megatron-core 0.15.2, not core_v0.16.1" in report.results[1]["detail"]
    assert steps.megatron_lm_version(str(tree)) == "0.15.2"


def test_steady_step_time_leaves_out_the_warm_up_windows():
    records = [{"kind": "train", "iteration": i, "step_time_s": t}
               for i, t in [(10, 9.0), (20, 1.2), (30, 1.0), (40, 1.1), (50, 1.0), (60, 5.0)]]
    records.append({"kind": "valid", "iteration": 60, "loss": 3.0})
    assert steps.steady_step_time(records, warmup_iters=20) == pytest.approx(1.05)
    assert steps.steady_step_time(records, warmup_iters=60) is None


def test_carried_corpus_is_found_by_its_files(tmp_path, monkeypatch):
    for name in steps.CORPUS_FILES:
        (tmp_path / name).write_text("")
    monkeypatch.setenv("GPU_CHECK_CORPUS", str(tmp_path))
    folder, how = steps.find_corpus(dict(smoke=True, work=str(tmp_path / "work")))
    assert folder == str(tmp_path) and how.startswith("carried corpus")


def test_a_failed_step_makes_the_exit_status_nonzero(tmp_path):
    # GPU mode on a machine without a GPU: env fails (no CUDA device); out of budget, triton
    # is not run, which is said and is not a failure of its own.
    result = subprocess.run(["bash", SCRIPT, "--steps", "env,triton", "--budget-s", "25"],
                            cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    statuses = _statuses(result.stdout)
    assert statuses["env"] == "FAIL" and statuses["triton"] == "SKIP"
    assert "torch sees no CUDA device" in result.stdout and "not run (budget)" in result.stdout
    assert "-> FAIL (env)" in result.stdout
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["result"] == "FAIL" and report["failed"] == ["env"]


def test_a_step_past_its_time_limit_is_killed_with_its_children():
    # The child starts a grandchild that holds the output pipe: both must go.
    child = ("import subprocess, sys, time; "
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "print('started', flush=True); time.sleep(60)")
    start = time.perf_counter()
    rc, output = steps.run_logged([sys.executable, "-c", child], timeout=2)
    assert rc is None and "started" in output  # None: killed at its limit
    assert time.perf_counter() - start < 30


def test_a_step_the_budget_cuts_short_is_skipped_not_failed():
    # The first H200 run: the DP=1 driver started with 39 s of budget left, was killed at
    # 24 s and reported FAIL "timed out", which read as a failure of the driver.
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    ctx = dict(deadline=time.time() + 18)  # 3 s left once the 15 s margin is kept
    rc, _, cut = steps.run_limited(ctx, sleeper, 120)
    assert rc is None and cut and steps.killed(cut)[0] == "SKIP"
    assert "not run to the end (budget)" in steps.killed(cut)[1]
    ctx = dict(deadline=time.time() + 600)  # its own limit, not the budget's: a failure
    rc, _, cut = steps.run_limited(ctx, sleeper, 2)
    assert rc is None and not cut and steps.killed(cut) == ("FAIL", "timed out")


def test_the_overlap_verdict_holds_shared_gpus_to_chance_and_own_gpus_to_the_target():
    # the second H200 run: 4 ranks on one GPU, rank 0's compute stream busy 28.4% of the
    # time (the other ranks hold the GPU the rest), quantization kernels beside it 38.2%
    seen = dict(mode="cuda kernels", share=0.382, overlapped_s=0.0007, quantized_s=0.0018,
                compute_busy=0.284, on_compute_stream_s=0.0)
    assert steps.overlap_verdict(seen, gpu_shared=True)[0] == "PASS"
    assert steps.overlap_verdict(seen, gpu_shared=False)[0] == "FAIL"  # one rank per GPU: 0.8
    held_back = dict(seen, share=0.05)  # a side stream the passes hold back: below chance
    assert steps.overlap_verdict(held_back, gpu_shared=True)[0] == "FAIL"
    assert steps.overlap_verdict(dict(seen, share=0.9), gpu_shared=False)[0] == "PASS"
    ctx = dict(smoke=False, env=dict(gpus=8))
    ranks, flags = steps.overlap_ranks(ctx)
    assert ranks == 8 and flags[flags.index("--distributed-backend") + 1] == "nccl"
    assert flags[flags.index("--sdp4bit-ranks-per-node") + 1] == "4"
    assert steps.overlap_ranks(dict(smoke=False, env=dict(gpus=1)))[0] == 4
    # an odd count: an even number of ranks, so the emulated nodes divide the host's
    ranks, flags = steps.overlap_ranks(dict(smoke=False, env=dict(gpus=5)))
    assert ranks == 4 and flags[flags.index("--sdp4bit-ranks-per-node") + 1] == "2"
    ranks, flags = steps.overlap_ranks(dict(smoke=False, env=dict(gpus=3)))
    assert ranks == 2 and "--sdp4bit-ranks-per-node" not in flags
