"""A micro-batch (or a model) too large for the memory (issue 28, round two): one line
per failing rank, exit 2, saying what to lower; the ranks left inside a collective
with it say in one line that another rank failed first. Before: the allocator's
traceback on every rank that met it (``RuntimeError: ... DefaultCPUAllocator: can't
allocate memory``; ``torch.OutOfMemoryError`` on a GPU) and gloo's ``Connection
closed by peer`` traceback on the others.

The allocations fail for real: the single-process runs have their address space
capped (``RLIMIT_AS``, so nothing is taken from the machine), and the torchrun job
has one rank ask for a petabyte in its forward pass (``allocation_entry.py``).
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
import torch

from megatron_sdp4bit.training.checkpoint import latest_iteration
from megatron_sdp4bit.training.lost_peer import LostPeer, lost_peer
from megatron_sdp4bit.training.out_of_memory import OutOfMemory, says_out_of_memory

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--default-corpus-mb", "1", "--eval-iters", "0", "--no-progress-bar", "--train-iters", "1"]
ADDRESS_SPACE = 6 << 30
"""The cap of the single-process runs: the driver's own needs about 2.5 GB of it."""


def _env(root):
    return {**os.environ, "SDP4BIT_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("oom")
    from megatron_sdp4bit.data import prepare_default_corpus

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDP4BIT_CACHE", str(root / "cache"))
        prepare_default_corpus(max_mb=1)
    return root


def _capped(argv, root):
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    env = {key: value for key, value in _env(root).items() if key != "RANK"}
    return subprocess.run([sys.executable, "-m", "megatron_sdp4bit.pretrain", *TINY, *argv], preexec_fn=cap,
                          capture_output=True, text=True, timeout=300, cwd=str(root), env=env)


def test_allocation_failures_become_one_line_and_other_errors_pass():
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)")
    for error in (cpu, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore"),
                  MemoryError()):
        with pytest.raises(OutOfMemory, match=r"^out of memory in iteration 1 \((\[enforce|CUDA out of memory\. "
                           r"Tried to allocate 20\.00 GiB\)|MemoryError\)).*: lower it$"):
            with says_out_of_memory("in iteration 1", "lower it"):
                raise error
    with pytest.raises(RuntimeError, match="^a bug$"):
        with says_out_of_memory("in iteration 1", "lower it"):
            raise RuntimeError("a bug")
    gone = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:17632. This is typically caused by a remote worker crashing.")
    assert str(lost_peer(gone)) == ("another rank left the job during a collective (Connection closed by peer "
                                    "[127.0.0.1]:17632): the rank that failed first says why, above or in the "
                                    "launcher's report")
    assert isinstance(lost_peer(gone), LostPeer) and lost_peer(RuntimeError("a bug")) is None


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch maps more than the cap holds")
def test_a_micro_batch_too_large_is_one_line_and_its_advice_trains(root):
    """8192 samples of 16 tokens in one micro-batch: 4 GiB of logits over the cap. The
    line's advice, a smaller micro-batch with the same global batch, trains."""
    done = _capped(["--micro-batch-size", "8192", "--run-dir", "big"], root)
    assert done.returncode == 2, done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(ours) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert ours[0].startswith("sdp4bit-pretrain: error (rank 0): out of memory in iteration 1 ([enforce fail at ")
    assert "DefaultCPUAllocator: can't allocate memory: you tried to allocate" in ours[0]
    assert ours[0].endswith("): lower --micro-batch-size 8192 and keep --global-batch-size 8192: each rank then "
                            "runs more, smaller micro-batches per iteration and trains the same samples")
    followed = _capped(["--micro-batch-size", "256", "--global-batch-size", "8192", "--run-dir", "small"], root)
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert "32 micro-batches of 256 per rank" in followed.stdout


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch maps more than the cap holds")
def test_a_model_too_large_to_build_names_the_model_flags(root):
    done = _capped(["--hidden-size", "32768", "--micro-batch-size", "1", "--run-dir", "wide"], root)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith("sdp4bit-pretrain: error (rank 0): out of memory building the model (GPT 1 layers x "
                           "32768) and its optimizer ([enforce fail at ")
    assert line.endswith("): build a smaller model (--num-layers, --hidden-size), or split it over more ranks "
                         "(--tensor-model-parallel-size, --pipeline-model-parallel-size)")


def test_under_torchrun_the_failing_rank_says_why_and_the_other_one_line(root):
    """Rank 1 alone runs out of memory in iteration 3, after the checkpoint of 2."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--monitor-interval", "0.1", os.path.join(HERE, "allocation_entry.py"), "1", "3",
               *TINY, "--train-iters", "6", "--micro-batch-size", "2", "--log-interval", "1", "--save-interval", "2",
               "--save", str(root / "ck"), "--run-dir", str(root / "job")]
    done = subprocess.run(command, env=_env(root), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("sdp4bit-pretrain:")]
    assert ours.pop(next(i for i, line in enumerate(ours) if "out of memory" in line)) == (
        "sdp4bit-pretrain: error (rank 1): out of memory in iteration 3 ([enforce fail at alloc_cpu.cpp:127] "
        "err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes. Error "
        "code 12 (Cannot allocate memory)): lower --micro-batch-size 2 and keep --global-batch-size 4: each rank "
        "then runs more, smaller micro-batches per iteration and trains the same samples")
    # rank 0, inside the gradients' all-reduce with rank 1, unless torchrun ended it first
    assert all(line.startswith("sdp4bit-pretrain: stopped (rank 0): another rank left the job during a "
                               "collective (Connection ") for line in ours), ours
    assert "[rank0]: Traceback" not in done.stderr and "[rank1]: Traceback" not in done.stderr, done.stderr[-3000:]
    assert "traceback : sdp4bit-pretrain: error: out of memory in iteration 3" in done.stderr  # torchrun's root cause
    assert latest_iteration(str(root / "ck")) == 2
