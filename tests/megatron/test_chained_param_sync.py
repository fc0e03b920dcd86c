"""A chained optimizer's member (MoE: dense and expert distributed optimizers) starts the
param sync of every bucket group of the model chunk in its step (megatron-core 0.16-0.19
without --overlap-param-gather); the layer sends only the member's own groups, so each
gather goes once, quantized, by the optimizer that holds its fresh weights."""
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.megatron.param_sync import _another_optimizers_group
from megatron_sdp4bit.megatron.state import LayerState

class _Member:
    """A chain member stand-in (the layer keeps which optimizers passed its refusals in
    a weak map)."""


DENSE, EXPERT = _Member(), _Member()


def _stepping(groups):
    state = LayerState(config=SDP4BitConfig())
    state.in_optimizer_step = True
    state.stepping_groups = frozenset(map(id, groups))
    return state


def test_a_members_step_skips_the_other_members_groups():
    state = _stepping([DENSE])
    assert _another_optimizers_group(state, EXPERT, force_sync=False)
    assert not _another_optimizers_group(state, DENSE, force_sync=False)


def test_a_forced_sync_or_one_outside_a_step_is_never_skipped():
    assert not _another_optimizers_group(_stepping([DENSE]), EXPERT, force_sync=True)
    idle = LayerState(config=SDP4BitConfig())
    assert not _another_optimizers_group(idle, EXPERT, force_sync=False)


class _OneRankLayer:
    """What step_with_ready_grads reads of a layer, for one data-parallel rank (nothing
    to gather; a DDP config that passes the refusals), with megatron's originals
    replaced by recorders."""

    def __init__(self):
        from types import SimpleNamespace

        self.state = LayerState(config=SDP4BitConfig())
        ddp_config = SimpleNamespace(use_distributed_optimizer=True, num_distributed_optimizer_instances=1)
        self.adapter = SimpleNamespace(gather_order=lambda optimizer: [],
                                       optimizer_group=lambda optimizer: (0, 1),
                                       ddp_config=lambda owner: ddp_config,  # checked at the first step
                                       unsupported_ddp_features=lambda config: [])
        self.seen = []  # (member, the iteration its step saw)

    def original(self, owner, name):
        from megatron_sdp4bit.megatron.param_sync import step_with_ready_grads

        from megatron_sdp4bit.megatron.param_sync import chained_step_with_ready_grads

        if owner == "chained_optimizer":  # megatron's chain: its members one after another
            return lambda chained: all([
                chained_step_with_ready_grads(self, m) if isinstance(m, list)  # a nested chain
                else step_with_ready_grads(self, m) for m in chained])
        return lambda member: self.seen.append((member, self.state.iteration)) or True


def test_a_chained_step_is_one_iteration_and_every_member_sees_the_same_one():
    # MoE chains a dense and an expert optimizer: counting each member's step made
    # get_iteration(), --sdp4bit-grad-start-iter and the intervals run at twice the pace.
    from megatron_sdp4bit.megatron.param_sync import (chained_step_with_ready_grads,
                                                      step_with_ready_grads)

    layer = _OneRankLayer()
    for _ in range(3):
        assert chained_step_with_ready_grads(layer, [DENSE, EXPERT])
    assert layer.state.iteration == 3 and not layer.state.chain_depth
    assert layer.seen == [(m, i) for i in range(3) for m in (DENSE, EXPERT)]
    assert step_with_ready_grads(layer, DENSE) and layer.state.iteration == 4  # unchained
    # megatron 0.18+ may nest a chain (its layer-wise optimizer) in the chain: still one
    layer.seen.clear()
    assert chained_step_with_ready_grads(layer, [[DENSE], EXPERT])
    assert layer.state.iteration == 5 and layer.seen == [(DENSE, 4), (EXPERT, 4)]
