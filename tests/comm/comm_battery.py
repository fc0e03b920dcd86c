"""Everything one spawned world runs, so each world size pays for process start-up once.

``battery(rank, world)`` returns ``{case key: plain data}``; the test modules
assert on those results (see conftest.world_results).
"""
from __future__ import annotations

import torch

import comm_cases_grads as grads
import comm_cases_stats as stats
import comm_cases_topology as topology
import comm_cases_weights as weights
from megatron_sdp4bit.comm import reset_generators


STATISTICS_WORLDS = (2, 4)


def ranks_per_node_choices(world: int) -> list[int]:
    """1, 2 and 4 ranks per node, where they divide the world."""
    return [rpn for rpn in (1, 2, 4) if rpn <= world and world % rpn == 0]


def battery(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    reset_generators()
    results: dict = {}
    for rpn in ranks_per_node_choices(world):
        topology.describe(rank, world, rpn, results)
        grads.matrix_cases(rank, world, rpn, results)
        grads.wire_cases(rank, world, rpn, results)
        grads.schedule_cases(rank, world, rpn, results)
        weights.one_step_cases(rank, world, rpn, results)
        weights.sliced_cases(rank, world, rpn, results)
        weights.weight_wire_cases(rank, world, rpn, results)
    if world in STATISTICS_WORLDS:  # statistics need many calls: not on the largest world
        stats.unbiased_cases(rank, world, 2, results)
        stats.reproducible_cases(rank, world, 2, results)
        stats.hadamard_cases(rank, world, 2, results)
        weights.error_feedback_cases(rank, world, 2, results)
    topology.bad_input_cases(rank, world, results)
    if world >= 4:
        topology.strided_dp_cases(rank, world, results)
        topology.bad_topology_cases(rank, world, results)
    return results
