"""``diagnostics.gloo_collectives``: the check of the gloo collectives megatron's bucket
groups issue passes on this torch, fails naming the collective when one is wrong, and
runs as installed under torchrun."""
from __future__ import annotations

import os
import subprocess

from harness import spawn_ranks
from megatron_sdp4bit.jobs import job_env, torchrun_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check_with_avg_done_as_sum(rank, world_size):
    """The real check, then again with a reduce-scatter that ignores AVG (sums)."""
    import torch.distributed as dist

    from megatron_sdp4bit.diagnostics.gloo_collectives import check_gloo_collectives
    from megatron_sdp4bit.patching import Patches

    check_gloo_collectives()
    real = dist.reduce_scatter_tensor

    def sum_always(output, input, op=dist.ReduceOp.SUM, **kwargs):
        return real(output, input, op=dist.ReduceOp.SUM, **kwargs)

    with Patches("test") as patches:
        patches.set(dist, "reduce_scatter_tensor", sum_always)
        try:
            check_gloo_collectives()
        except RuntimeError as error:
            return str(error)
    return None


def test_a_wrong_reduce_scatter_is_named():
    for message in spawn_ranks(_check_with_avg_done_as_sum, 2, timeout_s=120):
        assert message is not None and "gloo reduce_scatter_tensor (" in message and "AVG" in message
        assert "expected" in message


def test_it_runs_as_a_module_under_torchrun():
    env = job_env(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        torchrun_command(2, ["-m", "megatron_sdp4bit.diagnostics.gloo_collectives"]),
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the gloo collectives megatron's bucket groups use: correct on 2 ranks" in result.stdout
