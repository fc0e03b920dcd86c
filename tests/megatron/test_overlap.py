"""The layer's collectives overlap megatron's backward and forward passes (issue 26).

With --overlap-grad-reduce / --overlap-param-gather on gloo the layer hands every
stage of its collectives to a worker thread (``megatron/background.py``,
``comm/runner.py``). Checked on 4 ranks as 2 nodes x 2, several buckets:

- training with the worker thread is bit-identical to training with every
  collective run by the caller (the runner forced to ``inline``): losses and the
  weights' SHA-256 after every step, for overlapped gradients alone and both
  directions, bf16 and fp32, SDP4Bit (stochastic rounding) and the exact
  reduce-scatter as an all-to-all (the layer's own exact path);
- the collectives of both directions (and so the kernels between them, which run
  in the same job) are issued on the worker thread, never on the thread that runs
  megatron's backward and forward passes;
- the layer chose a thread runner, made once, and the layer's buffers stay one set
  per direction (``comm/memory_plan.py``'s bound holds);
- the deferring runner (NCCL under one hardware queue, here forced on gloo: its stages
  run on the caller) trains bit-identically too, without prefetching the gathers.
"""
from __future__ import annotations

import pytest

from harness import spawn_ranks
from harness.tiny_gpt import TinyGPTSpec
from megatron_sdp4bit.config import preset

pytestmark = pytest.mark.slow

WORLD, RANKS_PER_NODE, STEPS = 4, 2, 5
SPECS = {
    "bf16-grads": TinyGPTSpec(dtype="bf16", overlap_grad_reduce=True, bucket_size=4000),
    "bf16-both": TinyGPTSpec(dtype="bf16", overlap_grad_reduce=True, overlap_param_gather=True,
                             bucket_size=4000),
    "fp32-both": TinyGPTSpec(dtype="fp32", overlap_grad_reduce=True, overlap_param_gather=True,
                             bucket_size=4000, grad_reduce_in_fp32=True),
}
CONFIGS = {
    "sdp4bit": preset("sdp4bit", ranks_per_node=RANKS_PER_NODE),
    "exact-a2a": preset("baseline", ranks_per_node=RANKS_PER_NODE, exact_reduce_scatter="alltoall"),
}


def _train(spec, config, runner: str) -> dict:
    import threading

    from megatron_sdp4bit import comm
    from megatron_sdp4bit.comm import gather_hops, gradients, weights
    from megatron_sdp4bit.megatron import patch
    from harness.tiny_gpt import TinyGPTTrainer

    patch.uninstall()
    comm.reset_generators()
    threads = set()
    originals = {}

    def spy(module, name):
        original = originals[(module, name)] = getattr(module, name)

        def wrapped(*args, **kwargs):
            threads.add(threading.current_thread().name)
            return original(*args, **kwargs)

        setattr(module, name, wrapped)

    from megatron_sdp4bit.megatron import param_sync

    real_prefetch = param_sync.prefetch_gathers
    prefetched = []

    def prefetch(layer, optimizer):
        left = len(layer.state.prefetched)  # what megatron did not take since the last step
        real_prefetch(layer, optimizer)
        prefetched.append((left, len(layer.state.prefetched)))

    param_sync.prefetch_gathers = prefetch
    if runner != "thread":  # the caller's own, or the deferring runner (one hardware queue)
        config = config.replace(runner=runner)  # --sdp4bit-runner
    spy(gradients, "all_to_all_equal")  # the reduce-scatter's hops
    spy(weights, "all_gather_flat")  # the exact weight gathers
    spy(gather_hops, "all_gather_flat")  # the quantized ones' hops
    try:
        layer = patch.install(config)
        trainer = TinyGPTTrainer(spec)
        records = trainer.train_steps(STEPS)
        kind = layer.state.runner.kind
        params = sum(p.numel() for p in trainer.model.parameters())
        reported = patch.memory(trainer.optimizer, params).buffer_bytes
        buffers = layer.state.buffer_bytes()
        waits = patch.collective_waits()
    finally:
        param_sync.prefetch_gathers = real_prefetch
        for (module, name), original in originals.items():
            setattr(module, name, original)
        patch.uninstall()
    return {"losses": [r.loss for r in records], "hashes": [r.weights_sha256 for r in records],
            "buckets": trainer.num_buckets, "kind": kind, "threads": sorted(threads),
            "main": threading.current_thread().name, "buffers": (buffers, reported),
            "prefetched": prefetched, "waits": waits}


def _world(rank, world_size, cases):
    return [_train(*case) for case in cases]


@pytest.fixture(scope="module")
def runs():
    cases, names = [], []
    for spec_name, spec in SPECS.items():
        for config_name, config in CONFIGS.items():
            if config_name == "exact-a2a" and spec_name != "bf16-both":
                continue  # the exact path once is enough
            runners = ["thread", "inline"]
            if config_name == "sdp4bit" and spec.overlap_param_gather:
                runners.append("deferred")
            for runner in runners:
                cases.append((spec, config, runner))
                names.append((spec_name, config_name, runner))
    per_rank = spawn_ranks(_world, WORLD, cases, timeout_s=900)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(names)}


@pytest.mark.parametrize("spec_name,config_name", [
    ("bf16-grads", "sdp4bit"), ("bf16-both", "sdp4bit"), ("fp32-both", "sdp4bit"),
    ("bf16-both", "exact-a2a")])
def test_overlapped_training_is_bit_identical_to_the_callers_own(runs, spec_name, config_name):
    overlapped, inline = runs[(spec_name, config_name, "thread")], runs[(spec_name, config_name, "inline")]
    for rank, (a, b) in enumerate(zip(overlapped, inline)):
        assert a["kind"] == "thread" and b["kind"] == "inline", (a["kind"], b["kind"])
        assert a["buckets"] > 2, "the model must have several buckets"
        assert a["losses"] == b["losses"], f"rank {rank}: losses differ"
        assert a["hashes"] == b["hashes"], f"rank {rank}: weights differ"


@pytest.mark.parametrize("spec_name", ["bf16-both", "fp32-both"])
def test_training_on_the_deferring_runner_is_bit_identical_and_gathers_one_group_ahead(
        runs, spec_name):
    """One hardware queue (NCCL with CUDA_DEVICE_MAX_CONNECTIONS=1): every stage issued at
    megatron's later starts and waits, on the caller, gives the caller's own training
    bit for bit, and the weight gathers are not submitted at the optimizer step (their
    stages would all be issued there, ahead of the forward pass's kernels)."""
    deferred, inline = runs[(spec_name, "sdp4bit", "deferred")], runs[(spec_name, "sdp4bit", "inline")]
    for rank, (a, b) in enumerate(zip(deferred, inline)):
        assert a["kind"] == "deferred", a["kind"]
        assert a["losses"] == b["losses"], f"rank {rank}: losses differ"
        assert a["hashes"] == b["hashes"], f"rank {rank}: weights differ"
        assert a["prefetched"] == [], a["prefetched"]
        assert a["threads"] == [a["main"]]


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_the_collectives_run_on_the_worker_thread(runs, spec_name):
    for rank, run in enumerate(runs[(spec_name, "sdp4bit", "thread")]):
        assert run["threads"] == ["sdp4bit-collectives"], (rank, run["threads"])
        assert run["main"] != "sdp4bit-collectives"
    for run in runs[(spec_name, "sdp4bit", "inline")]:
        assert run["threads"] == [run["main"]]


def test_with_overlapped_gathers_every_step_submits_them_all_after_the_optimizer(runs):
    """--overlap-param-gather: each step's gathers are submitted right after the optimizer
    step (param_sync.prefetch_gathers), every bucket group's, and megatron takes them."""
    for spec_name, spec in SPECS.items():
        for run in runs[(spec_name, "sdp4bit", "thread")]:
            if spec.overlap_param_gather:  # every group's, each taken by megatron's forward
                assert len(run["prefetched"]) == STEPS, run["prefetched"]
                assert all(left == 0 and now > 1 for left, now in run["prefetched"]), run["prefetched"]
            else:
                assert run["prefetched"] == []


def test_megatrons_waits_on_the_overlapped_collectives_are_timed_per_direction(runs):
    """patch.collective_waits: on the worker thread the handles megatron waits on count
    their time, under the collective they belong to; a direction that is not overlapped
    hands megatron no handle, and collectives that ran on the caller (inline) are not
    timed: their wait is not what blocks the host."""
    for spec_name, spec in SPECS.items():
        for run in runs[(spec_name, "sdp4bit", "thread")]:
            (rs_s, rs_n), (ag_s, ag_n) = run["waits"]["reduce_scatter"], run["waits"]["all_gather"]
            assert rs_s > 0 and rs_n >= STEPS, run["waits"]
            assert (ag_s > 0 and ag_n >= STEPS) == spec.overlap_param_gather, run["waits"]
        for run in runs[(spec_name, "sdp4bit", "inline")]:
            assert run["waits"] == {"reduce_scatter": (0.0, 0), "all_gather": (0.0, 0)}, run["waits"]


def test_the_buffers_stay_one_set_per_direction(runs):
    for name, per_rank in runs.items():
        for held, reported in (run["buffers"] for run in per_rank):
            assert held <= reported, (name, held, reported)


def _set_up_twice(caplog, monkeypatch, overlap_param_gather: bool, config=preset("sdp4bit"),
                  grads_on: str = "cpu"):
    """``background.set_up_runner`` for two model chunks of a one-bucket-group DDP with
    --overlap-grad-reduce: the layer state, the INFO lines logged and the kinds the ranks
    were asked to agree on (``check_same_kind_everywhere``, a world collective here)."""
    import logging
    import types

    import torch

    from megatron_sdp4bit.megatron import background
    from megatron_sdp4bit.megatron.state import LayerState

    ddp_config = types.SimpleNamespace(overlap_grad_reduce=True,
                                       overlap_param_gather=overlap_param_gather)
    adapter = types.SimpleNamespace(
        ddp_config=lambda ddp: ddp_config, ddp_bucket_groups=lambda ddp: ["bucket group"],
        grad_buffers=lambda bucket_group: [types.SimpleNamespace(device=torch.device(grads_on))])
    state = LayerState(config=config)
    agreed = []
    monkeypatch.setattr(background, "check_same_kind_everywhere", agreed.append)
    with caplog.at_level(logging.INFO, logger=background.__name__):
        background.set_up_runner(state, adapter, "ddp", ["group"], [[[0, 1]]])
        background.set_up_runner(state, adapter, "ddp", ["group"], [[[0, 1]]])  # a 2nd chunk
    return state, [r.getMessage() for r in caplog.records], agreed


def test_a_backend_that_cannot_overlap_says_so_in_one_info_line(monkeypatch, caplog):
    """A world whose backend can run collectives neither from a worker thread nor on a
    side stream keeps them on the caller, with one INFO line saying they are not
    overlapped (never a hang)."""
    from megatron_sdp4bit.comm import runner_choice
    from megatron_sdp4bit.comm.runner import InlineRunner
    from megatron_sdp4bit.megatron import background

    monkeypatch.setattr(runner_choice, "runner_kind", lambda group, device: "inline")
    monkeypatch.setattr(background, "backend_of", lambda group, device: "mpi")
    state, lines, agreed = _set_up_twice(caplog, monkeypatch, overlap_param_gather=False)
    assert len(lines) == 1 and "mpi backend" in lines[0] and "not overlapped" in lines[0]
    assert agreed == ["inline"]  # once, by the first model chunk
    assert isinstance(state.runner, InlineRunner) and state.runner_chosen


@pytest.mark.parametrize("connections, says", [("1", True), ("8", False), (None, False)])
def test_one_hardware_queue_on_the_stream_runner_says_what_it_costs(monkeypatch, caplog,
                                                                     connections, says):
    """With CUDA_DEVICE_MAX_CONNECTIONS=1 every stream shares one hardware queue, where a
    wait for an NCCL hop in flight blocks the kernels behind it: the layer takes the
    deferring runner instead of the stream runner, and says so in one INFO line."""
    import types

    from megatron_sdp4bit.comm import runner_choice
    from megatron_sdp4bit.megatron import background

    if connections is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
    monkeypatch.setattr(runner_choice, "runner_kind", lambda group, device: "stream")
    monkeypatch.setattr(background, "make_runner",
                        lambda kind, device: types.SimpleNamespace(kind=kind))
    state, lines, agreed = _set_up_twice(caplog, monkeypatch, overlap_param_gather=True)
    assert agreed == [state.runner.kind]  # every rank must choose the same: chunks differ
    if says:
        assert state.runner.kind == "deferred"
        assert len(lines) == 1 and "CUDA_DEVICE_MAX_CONNECTIONS=1" in lines[0]
        assert "issued at megatron's next start or wait" in lines[0]
        assert "a bucket of up to 64 M elements in one chunk" in lines[0]
    else:
        assert state.runner.kind == "stream" and lines == []


def _asked(monkeypatch, caplog, requested: str, backend: str, grads_on: str):
    """``set_up_runner`` with ``--sdp4bit-runner requested`` on ``backend``, the gradients on
    ``grads_on``: (the kind made, the INFO lines, the kinds agreed on); runners are stand-ins."""
    import types

    from megatron_sdp4bit.comm import runner_choice
    from megatron_sdp4bit.megatron import background

    from megatron_sdp4bit.comm.deferring_runner import DeferringRunner
    from megatron_sdp4bit.comm.runner import InlineRunner, StreamRunner, ThreadRunner

    runners = {cls.kind: cls for cls in (InlineRunner, StreamRunner, ThreadRunner, DeferringRunner)}
    monkeypatch.setattr(runner_choice, "backend_of", lambda group, device: backend)
    monkeypatch.setattr(background, "make_runner", lambda kind, device: types.SimpleNamespace(
        kind=kind, private_groups=runners[kind].private_groups))
    twins = []
    monkeypatch.setattr(background, "build_private_groups", twins.append)
    monkeypatch.setattr(background, "private_group", lambda group: group)
    state, lines, agreed = _set_up_twice(caplog, monkeypatch, overlap_param_gather=True,
                                         config=preset("sdp4bit", runner=requested),
                                         grads_on=grads_on)
    return getattr(state.runner, "kind", None), lines, agreed, twins


@pytest.mark.parametrize("requested, backend, grads_on, words", [
    ("inline", "gloo", "cpu", "not overlapped"),
    ("inline", "nccl", "cuda", "not overlapped"),
    ("thread", "gloo", "cuda", "on a worker thread"),
    ("stream", "gloo", "cuda", "on a CUDA side stream"),      # gpu_check: NCCL's runner on one GPU
    ("deferred", "gloo", "cpu", "issued at megatron's next start or wait"),
    ("deferred", "nccl", "cuda", "issued at megatron's next start or wait"),
])
def test_the_runner_flag_takes_the_runner_it_names_and_says_so(monkeypatch, caplog, requested,
                                                               backend, grads_on, words):
    """``--sdp4bit-runner`` other than auto: that runner, whatever the backend would pick,
    with one INFO line naming the flag; every rank still agrees on it. Under
    CUDA_DEVICE_MAX_CONNECTIONS=1 a named stream runner stays one (auto would defer)."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    kind, lines, agreed, twins = _asked(monkeypatch, caplog, requested, backend, grads_on)
    assert agreed == [requested]
    assert kind == requested
    assert len(lines) == 1 and lines[0].startswith(f"SDP4Bit: --sdp4bit-runner {requested}: ")
    assert words in lines[0]
    # the runners whose collectives run beside the caller's get private groups: a worker
    # thread (gloo pairs two threads' collectives on one group wrongly) and a side stream
    # (NCCL runs one communicator's collectives in issue order, so megatron's own would
    # queue behind the prefetched gathers); inline and deferred issue in the caller's order
    assert bool(twins) == (requested in ("thread", "stream"))


@pytest.mark.parametrize("requested, backend, grads_on, why", [
    ("thread", "nccl", "cuda", "a worker thread runs gloo's collectives, and this job's run on nccl"),
    ("stream", "gloo", "cpu", "its side stream is a CUDA stream, and this job's gradients are on cpu"),
])
def test_a_runner_that_cannot_run_is_refused_in_one_line(monkeypatch, caplog, requested, backend,
                                                         grads_on, why):
    with pytest.raises(RuntimeError) as error:
        _asked(monkeypatch, caplog, requested, backend, grads_on)
    message = str(error.value)
    assert "\n" not in message
    assert message == (f"SDP4Bit: --sdp4bit-runner {requested} cannot run here: {why}; "
                       "leave it at auto (the runner for this backend)")


def test_auto_is_the_backends_runner(monkeypatch, caplog):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert _asked(monkeypatch, caplog, "auto", "gloo", "cpu")[:3] == ("thread", [], ["thread"])
    assert _asked(monkeypatch, caplog, "auto", "nccl", "cuda")[:3] == ("stream", [], ["stream"])
