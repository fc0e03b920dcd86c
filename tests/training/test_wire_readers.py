"""One convention for the layer's byte counters: they only grow, and every reader takes
its windows as differences. The driver's ``WireMeter`` and the Megatron-LM route's
``LayerFigures`` read the same counters over the same steps, each at its own moments,
and neither changes what the other sees (before, the meter reset the counters and the
reporter, which took differences, got negative or missing bytes). The same for the
clock of the overlapped collectives' waits (``WaitMeter`` and the reporter's
``waited-*``, per Megatron-LM iteration)."""
import pytest

from megatron_sdp4bit.comm.accounting import WireStats
from megatron_sdp4bit.config import preset
from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.megatron_lm.reporting import LayerFigures
from megatron_sdp4bit.training.meters import WaitMeter, WireMeter


@pytest.fixture
def layer():
    patch.uninstall()
    yield patch.install(preset("baseline"))
    patch.uninstall()


def _step(layer, sent: int, exact: int) -> None:
    """What one step's collectives record into the layer's counters, and a timed wait on
    its reduce-scatter of ``sent`` ms."""
    layer.state.wire.add("reduce_scatter", "intra", values=sent, exact=exact)
    layer.state.wire.call("reduce_scatter")
    layer.state.waits.seconds["reduce_scatter"] += sent / 1000
    layer.state.waits.waits["reduce_scatter"] += 1


def test_the_meter_and_the_reporter_agree_over_the_same_steps(layer):
    _step(layer, 999, 999)  # before either reader starts: counted by neither
    meter, waits, figures = WireMeter(), WaitMeter(), LayerFigures()
    figures.start(0)
    windows = {"meter": [], "reporter": [], "waits": [], "reporter waits": []}
    for i, (sent, exact) in enumerate([(100, 400), (50, 200), (7, 28), (3, 12)]):
        _step(layer, sent, exact)
        if i % 2 == 0:  # the meter logs every other step, the reporter every step
            windows["meter"].append(meter.read()["sent"])
            windows["waits"].append(round(waits.read()["reduce_scatter"] * 1000))
        window = figures.window(i + 1)
        windows["reporter"].append(window["bytes-sent"])
        windows["reporter waits"].append(round(window["waited-reduce-scatter"] * 1000))
        assert "waited-all-gather" not in window  # never timed: absent, not 0
    windows["meter"].append(meter.read()["sent"])
    windows["waits"].append(round(waits.read()["reduce_scatter"] * 1000))
    assert windows["reporter"] == windows["reporter waits"] == [100, 50, 7, 3]
    assert windows["meter"] == windows["waits"] == [100, 57, 3]
    assert waits.read() == {"reduce_scatter": None, "all_gather": None}  # no wait since
    assert meter.totals["sent"] == figures.totals["sent"] == 160
    assert meter.totals["exact"] == figures.totals["exact"] == 640
    assert patch.wire_stats().sent_bytes() == 1159  # the run's whole count, untouched by the readers


def test_a_window_is_the_difference_of_two_snapshots():
    recorder_stats = WireStats({("all_gather", "inter", "codes"): 10}, {"all_gather": 1})
    later = WireStats({("all_gather", "inter", "codes"): 25, ("reduce_scatter", "intra", "exact"): 4},
                      {"all_gather": 2, "reduce_scatter": 1})
    window = later.since(recorder_stats)
    assert window.sent_bytes() == 15 and window.exact_bytes() == 4
    assert window.calls == {"all_gather": 1, "reduce_scatter": 1}
    with pytest.raises(ValueError, match="not an earlier snapshot"):
        recorder_stats.since(later)  # counters that went down: another layer's, or reset
