"""Every rank makes the same world collectives at DDP construction, whatever groups it
holds: a pipeline stage without expert layers has no expert bucket groups, and before it
made one world all-gather fewer than the stages with experts (a hang)."""
import torch

from megatron_sdp4bit.megatron import layer


def test_the_rank_lists_are_one_gather_and_cover_ranks_with_fewer_groups(monkeypatch):
    # 4 ranks: stage 0 (ranks 0, 1) holds dense + expert groups, stage 1 (2, 3) dense only
    held = {0: [(0, 1), (0,)], 1: [(0, 1), (1,)], 2: [(2, 3)], 3: [(2, 3)]}
    gathers = []

    def all_gather_object(out, obj):
        gathers.append(obj)
        out[:] = [held[r] for r in range(4)]

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda group: list(group))
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    for rank in (0, 2):
        lists = layer._all_data_parallel_rank_lists(held[rank])
        assert lists == [[(0, 1), (2, 3)], [(0,), (1,)]]  # the same on both stages
    assert len(gathers) == 2  # one world collective per call, on every rank
