"""A chained optimizer's member (MoE: dense and expert distributed optimizers) starts the
param sync of every bucket group of the model chunk in its step (megatron-core 0.16-0.19
without --overlap-param-gather); the layer sends only the member's own groups, so each
gather goes once, quantized, by the optimizer that holds its fresh weights."""
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.megatron.param_sync import _another_optimizers_group
from megatron_sdp4bit.megatron.state import LayerState

DENSE, EXPERT = object(), object()


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
