"""SDP4Bit in Megatron-LM's output: the iteration line, TensorBoard / W&B, a summary.

Without this a user sees one INFO line per rank and nothing else; the only way to know
quantization ran is to compare losses with an exact run. ``install_reporting`` wraps
two of Megatron-LM's training functions (``RouteSites``):

- ``train``: when it starts (the model is built and the layer installed by then,
  whichever route installed it, even from inside the model provider, the 0.16/0.17
  patch), rank 0 prints one line with the config and the lines of the layer's plan
  (the nodes learned from the hosts, each data-parallel group's hops), and the layer samples its
  quantization errors on the last step of every ``--log-interval``; when it returns,
  the last rank prints a summary like the driver's;
- ``training_log``: while it runs, the iteration line it prints (``print_rank_last``,
  the last rank) ends with what the layer measured since the previous line: bytes this
  rank sent against the exact collectives (``patch.wire_stats()``), the replica checks
  passed so far (``--sdp4bit-check-interval``), the sampled relative quantization
  errors and the gradients' 4-bit group shape (crest factors; the error without and
  with the Hadamard rotation: what TLq-HS buys on this run), and under Megatron's overlap
  flags how long the training thread waited on the overlapped collectives per
  iteration (``patch.collective_waits``); the same figures go to Megatron-LM's TensorBoard and W&B writers when they
  are configured (they live on that rank), under ``sdp4bit/``.

All figures are per rank (the last rank's, the one that prints), taken from what the
layer already counts: nothing is added to a training step but the error samples, one
step in ``--log-interval``. The layer's wire counters only grow (nobody resets them): a
window is the difference of two snapshots, as for every reader of ``patch.wire_stats()``
(the driver's ``training/meters.py`` too).
"""
from __future__ import annotations

import inspect
from typing import Dict, Optional

import torch

from megatron_sdp4bit.comm.accounting import WireStats
from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.megatron.group_handle import waited_text
from megatron_sdp4bit.megatron.adapters.route_sites import RouteSites
from megatron_sdp4bit.patching import Patches

MIB = float(1 << 20)

MARK = "__sdp4bit_reporting__"
"""Carried by the wrapped training functions: installed once."""


class LayerFigures:
    """The layer's counters, read as windows (since the last read) and totals."""

    def __init__(self) -> None:
        self.start_iteration = None
        self._seen = WireStats()
        self._waited = patch.collective_waits()
        self._iteration = 0  # Megatron-LM's iteration at the last window
        self.totals = {"sent": 0, "exact": 0}
        self.errors: Dict[str, float] = {}
        """The latest sampled errors (kept for the summary)."""

    def start(self, iteration: int) -> None:
        """Count from now, Megatron-LM's ``iteration`` (the model is built; its construction
        sent nothing through the layer)."""
        self._seen = patch.wire_stats()
        self._waited = patch.collective_waits()
        self.totals = {"sent": 0, "exact": 0}
        self.start_iteration = patch.get_iteration()
        self._iteration = iteration

    def window(self, iteration: Optional[int] = None) -> dict:
        """The figures since the last window, up to Megatron-LM's ``iteration`` (its own
        count: skipped steps included, as in its time per iteration; None: the same as
        the last window's, for a reader of the totals only)."""
        iteration = self._iteration if iteration is None else iteration
        now = patch.wire_stats()
        stats, self._seen = now.since(self._seen), now
        window = {"sent": stats.sent_bytes(), "exact": stats.exact_bytes()}
        for key, value in window.items():
            self.totals[key] += value
        errors = patch.quantization_errors()
        self.errors.update(errors)
        shape = patch.gradient_group_shape()
        waited, before = patch.collective_waits(), self._waited
        steps = max(iteration - self._iteration, 1)
        self._waited, self._iteration = waited, iteration
        return {"bytes-sent": window["sent"], "bytes-exact": window["exact"],
                "replica-checks-passed": patch.replica_checks_passed(),
                # seconds per iteration the training thread waited on the overlapped
                # collectives, for the directions a wait was timed for
                **{f"waited-{kind.replace('_', '-')}": (seconds - before[kind][0]) / steps
                   for kind, (seconds, waits) in waited.items() if waits > before[kind][1]},
                **{f"quant-error-{name}": value for name, value in errors.items()},
                **{f"grad-groups-{name.replace('_', '-')}": value for name, value in shape.items()}}


def iteration_line_fields(figures: dict) -> str:
    """Megatron-LM's ``' name: value |'`` fields for the iteration line."""
    line = ""
    if figures["bytes-exact"]:
        line += (f" sdp4bit bytes sent/exact: {figures['bytes-sent'] / figures['bytes-exact']:.3f} "
                 f"({figures['bytes-sent'] / MIB:.2f}/{figures['bytes-exact'] / MIB:.2f} MiB) |")
    line += f" sdp4bit replica checks passed: {figures['replica-checks-passed']} |"
    waited = waited_text(figures.get("waited-reduce-scatter"), figures.get("waited-all-gather"), "iter")
    if waited:  # overlapped on gloo: what the training thread still waited for
        line += f" sdp4bit{waited[2:]} |"
    for name, value in figures.items():
        if name.startswith("quant-error-"):
            line += f" sdp4bit {name[len('quant-error-'):]} error: {value:.3E} |"
    if "grad-groups-crest-p99" in figures:  # the 4-bit gradient groups' outliers, sampled
        line += (f" sdp4bit grad groups crest p99: {figures['grad-groups-crest-p99']:.2f}"
                 f" ({100 * figures['grad-groups-crest-share-above-8']:.2f}% above 8),"
                 f" 4-bit error TLq/TLq-HS: {figures['grad-groups-error-tlq']:.3f}"
                 f"/{figures['grad-groups-error-tlq-hs']:.3f} |")
    return line


def write_figures(writers, figures: dict, iteration: int) -> None:
    """The figures to Megatron-LM's TensorBoard (``add_scalar``) and W&B (``log``)
    writers, where configured; ``bytes-ratio`` beside the two byte counts."""
    scalars = {f"sdp4bit/{name}": value for name, value in figures.items()}
    if figures["bytes-exact"]:
        scalars["sdp4bit/bytes-ratio"] = figures["bytes-sent"] / figures["bytes-exact"]
    tensorboard, wandb = (get() for get in writers)
    if tensorboard is not None:
        for name, value in scalars.items():
            tensorboard.add_scalar(name, value, iteration)
    if wandb is not None:
        wandb.log(scalars, iteration)


def summary_lines(figures: LayerFigures, config, iterations: int) -> list:
    """The end-of-run block (the driver's ``=== summary ===`` wording for the wire)."""
    sent, exact = figures.totals["sent"], figures.totals["exact"]
    if exact:
        wire = (f"{sent / MIB:.2f} MiB vs {exact / MIB:.2f} MiB with the exact all-gather and FP32 "
                f"reduce-scatter ({sent / exact:.3f}x, {exact / max(sent, 1):.2f}x less)")
    else:
        wire = "not counted (bytes are counted for the distributed optimizer's collectives only)"
    start = figures.start_iteration or 0
    lines = ["", f"=== SDP4Bit summary (rank {torch.distributed.get_rank()}) ===",
             f"iterations          {iterations - start} in this run"
             + (f" (resumed at step {start})" if start else ""),
             f"weights / grads     {config.weight_mode} / {config.grad_mode}",
             f"bytes sent per rank {wire}"]
    if config.check_interval:
        lines.append(f"replica checks      {patch.replica_checks_passed()} passed (every "
                     f"{config.check_interval} steps, all data-parallel replicas bit-identical)")
    errors = ", ".join(f"{name} {value:.3E}" for name, value in sorted(figures.errors.items()))
    lines.append(f"quantization errors {errors or 'none sampled'} (relative L2, last sample)")
    return lines


def _is_last_rank() -> bool:
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def _start(sites: RouteSites, figures: LayerFigures, model) -> None:
    """Once, when training starts: the error sampling interval (on the last rank, which
    alone reads the samples: sampling draws from a private generator, so the ranks'
    collectives are the same either way), the counters' origin,
    rank 0's install line and its plan (the nodes found, each data-parallel group's
    hops: ``patch.collective_plan``) for ``model``, Megatron-LM's list of DDP chunks."""
    if not patch.is_installed() or figures.start_iteration is not None:
        return
    if _is_last_rank():  # the one rank that reads the samples (its log line, its summary)
        patch.set_metrics_interval(int(sites.get_args().log_interval))
    figures.start(int(getattr(sites.get_args(), "iteration", 0) or 0))  # 0, or where it resumed
    if torch.distributed.get_rank() == 0:
        print(f"SDP4Bit installed (megatron-core {patch.adapter_minor()} adapter, "
              f"{torch.distributed.get_world_size()} ranks): {patch.current_config().describe()}; "
              f"{patch.current_config().to_dict()}", flush=True)
        for line in patch.collective_plan(model or []):
            print(f"sdp4bit {line}", flush=True)
        if getattr(sites.get_args(), "data_parallel_size", None) == 1:
            # Before: the run said it was installed and quantized nothing, without a word.
            print("sdp4bit: data-parallel size 1: nothing to quantize (SDP4Bit quantizes the data-parallel "
                  "reduce-scatter and all-gather): run more ranks, or fewer tensor/pipeline/context-parallel "
                  "ones", flush=True)


def _wrap_training_log(sites: RouteSites, figures: LayerFigures, original):
    signature = inspect.signature(original)
    printer = getattr(sites.training, sites.log_printer)

    def training_log(*args, **kwargs):
        if not patch.is_installed() or not _is_last_rank():
            return original(*args, **kwargs)
        added = {}
        iteration = signature.bind_partial(*args, **kwargs).arguments["iteration"]

        def print_with_layer(message):
            if not added and " iteration " in str(message) and "consumed samples" in str(message):
                added.update(figures.window(iteration))
                message = str(message) + iteration_line_fields(added)
            printer(message)

        with Patches("SDP4Bit log") as during_log:
            during_log.set(sites.training, sites.log_printer, print_with_layer)
            result = original(*args, **kwargs)
        if added:
            write_figures(sites.writers, added, iteration)
        return result

    return training_log


def _wrap_train(sites: RouteSites, figures: LayerFigures, original):
    def summary() -> None:
        if patch.is_installed() and figures.start_iteration is not None and _is_last_rank():
            figures.window()  # the steps after the last log line
            print("\n".join(summary_lines(figures, patch.current_config(), patch.get_iteration())), flush=True)

    signature = inspect.signature(original)

    def train(*args, **kwargs):
        _start(sites, figures, signature.bind_partial(*args, **kwargs).arguments.get("model"))
        try:
            result = original(*args, **kwargs)
        except SystemExit as stop:  # --exit-interval, --exit-duration-in-mins, a signal
            if not stop.code:
                summary()
            raise
        summary()
        return result

    return train


def install_reporting(sites: RouteSites, patches: Patches) -> None:
    """Put the layer's figures into Megatron-LM's output (see the module docstring),
    until ``patches`` is restored; a second call (both routes combined) changes nothing.
    Whether a layer is installed is asked at each call: a run without ``--sdp4bit`` logs as megatron does."""
    if getattr(getattr(sites.training, sites.training_log), MARK, False):
        return
    figures = LayerFigures()
    for name, wrap in ((sites.training_log, lambda f: _wrap_training_log(sites, figures, f)),
                       (sites.train, lambda f: _wrap_train(sites, figures, f))):
        wrapped = wrap(getattr(sites.training, name))
        setattr(wrapped, MARK, True)
        patches.set(sites.training, name, wrapped)
