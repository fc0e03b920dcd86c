"""The run-time replica check (``check_interval``): data-parallel ranks must hold
bit-identical weights; one rank's corrupted weights stop every rank, naming the
bucket and the ranks, at the next check and not before."""
from __future__ import annotations

import torch

from harness import spawn_ranks
from harness.tiny_gpt import TinyGPTSpec
from megatron_sdp4bit.config import preset
from megatron_sdp4bit.megatron.consistency import buffer_digest

CORRUPTED_RANK = 2


def _flip_lowest_bit(tensor: torch.Tensor, index: int) -> None:
    """One ulp of a bf16 element (a change fp32 arithmetic would round away)."""
    with torch.no_grad():
        tensor.view(torch.int16)[index] ^= 1


def _train_then_corrupt(rank, world_size, interval):
    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit import comm
    from megatron_sdp4bit.megatron import patch
    from megatron_sdp4bit.megatron.consistency import ReplicaMismatch

    comm.reset_generators()
    patch.install(preset("sdp4bit", ranks_per_node=2, check_interval=interval))
    trainer = TinyGPTTrainer(TinyGPTSpec(dtype="bf16"))
    try:
        trainer.train_steps(4)  # checks at the start of steps 2 and 4 pass
        if rank == CORRUPTED_RANK:  # one element of another rank's shard
            # (a one-ulp change can heal: adding the next difference rounds both copies to
            # the same bf16 value; 1.5x does not)
            with torch.no_grad():
                trainer.model.buffers[0].buckets[0].param_data[1] *= 1.5
        done = 0
        try:
            for _ in range(4):
                trainer.train_steps(1)
                done += 1
        except ReplicaMismatch as error:
            return done, str(error)
        return done, None
    finally:
        patch.uninstall()


def test_one_corrupted_rank_stops_every_rank_naming_bucket_and_ranks():
    results = spawn_ranks(_train_then_corrupt, 4, 2, timeout_s=600)
    # 4 steps done, corruption; step 5 runs (no check at its start), step 6's check fails.
    assert [done for done, _ in results] == [1] * 4, results
    messages = {message for _, message in results}
    assert len(messages) == 1, messages  # every rank says the same
    [message] = messages
    assert "after 5 steps" in message
    assert "buffer 0 bucket 0: ranks [0, 1, 3] vs ranks [2]" in message


def test_check_interval_0_never_checks():
    results = spawn_ranks(_train_then_corrupt, 4, 0, timeout_s=600)
    assert [done for done, _ in results] == [4] * 4  # the drift goes unnoticed


def test_digest_sees_one_bit_and_not_equal_copies():
    x = torch.randn(1000).to(torch.bfloat16)
    y = x.clone()
    assert torch.equal(buffer_digest(x), buffer_digest(y))
    _flip_lowest_bit(y, 999)
    assert not torch.equal(buffer_digest(x), buffer_digest(y))
    odd = torch.arange(7, dtype=torch.uint8)  # not whole 4-byte words: byte view
    assert buffer_digest(odd).tolist() == [21, 0]
