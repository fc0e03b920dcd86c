"""The training run: one step at a time, and the log / evaluate / save policy applied.

``TrainingRun(parts)`` trains the parts ``setup.set_up`` built:
``train_step()`` is one iteration (nothing else), ``advance()`` is one iteration
with its bookkeeping and whatever ``StepPolicy`` asks for after it (a log line,
an evaluation, a checkpoint, a stop), ``train()`` advances to ``--train-iters``
and ``summary()`` says how it went. ``on_step(run)``, when given, is called
after every iteration, before the policy's actions (a test reads the weights
there; a script counts what a step did). ``launcher``, when given, is watched:
its death stops the run like a signal (``signals.py``, ``launcher_watch.py``).
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Callable, Optional

from megatron_sdp4bit.launcher_watch import Launcher
from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.training import checkpoint
from megatron_sdp4bit.training.console import is_rank0, log0
from megatron_sdp4bit.training.datasets import data_iterators
from megatron_sdp4bit.training.distributed import all_reduce_mean, is_loss_rank, parallel_ranks
from megatron_sdp4bit.training.meters import TrainingWindow, WaitMeter, WireMeter
from megatron_sdp4bit.training.metrics import MetricsLogger, default_run_dir, plot_losses
from megatron_sdp4bit.training.out_of_memory import lower_the_micro_batch, says_out_of_memory
from megatron_sdp4bit.training.policy import Actions, StepPolicy
from megatron_sdp4bit.training.setup import RunParts
from megatron_sdp4bit.training.signals import StopOnSignals, StoppedBySignal, StopRequest
from megatron_sdp4bit.training import step as steps


class NonFiniteTraining(RuntimeError):
    """The loss or the gradients stayed non-finite: training stops without saving."""


class TrainingRun:
    def __init__(self, parts: RunParts, on_step: Optional[Callable[["TrainingRun"], None]] = None,
                 forward_step: Optional[Callable] = None, launcher: Optional[Launcher] = None):
        args = parts.args
        self.parts, self.args = parts, args
        self.on_step = on_step
        # Looked up here, not at import: a test entry point may replace the module's.
        self.forward_step = forward_step or steps.forward_step
        self.policy = StepPolicy.from_args(args)
        self.iteration = parts.start_iteration
        self.run_dir = args.run_dir or default_run_dir()
        self.logger = MetricsLogger(self.run_dir, enabled=is_rank0(), total_iters=args.train_iters,
                                    progress_bar=not args.no_progress_bar,
                                    tensorboard_dir=args.tensorboard_dir, start_iteration=self.iteration)
        self.meter = WireMeter()
        self.waits = WaitMeter()
        self.train_iter = data_iterators(parts.train_ds, args, parts.layout,
                                         self.iteration * args.global_batch_size)
        self.window = TrainingWindow(parts.device)
        self.tokens_per_step = args.global_batch_size * args.seq_length
        self.last_loss = math.nan
        self.last_valid: Optional[float] = None  # no evaluation yet (or none at all: --eval-iters 0)
        self.tokens_total, self.time_total = 0, 0.0
        self.skipped_streak = 0
        self.grad_norm = None
        self.launcher = launcher
        self.stop_signals = StopOnSignals(args.exit_signal, launcher) if args.exit_signal_handler else None

    @property
    def ddp(self):
        return self.parts.ddp

    # --- one iteration -------------------------------------------------------------------

    def train_step(self) -> tuple:
        """One iteration: (loss tensor, grad norm, whether the optimizer stepped)."""
        parts = self.parts
        with says_out_of_memory(f"in iteration {self.iteration + 1}", self._lower_the_micro_batch()):
            return steps.train_step(parts.ddp, parts.optimizer, parts.scheduler, self.args, self.train_iter,
                                    parts.num_microbatches, forward_step_func=self.forward_step)

    def _lower_the_micro_batch(self) -> str:
        return lower_the_micro_batch(self.args.micro_batch_size, self.args.global_batch_size)

    def advance(self) -> Actions:
        """One iteration, its bookkeeping, the callback, then the policy's actions."""
        loss, self.grad_norm, ok = self.train_step()
        self.iteration += 1
        self.window.add(loss, ok)
        self.skipped_streak = 0 if ok else self.skipped_streak + 1
        if self.on_step is not None:
            self.on_step(self)
        actions = self.policy.after_step(self.iteration, self.skipped_streak)
        self.apply(actions)
        return actions

    def apply(self, actions: Actions) -> None:
        if actions.log:
            self.log_window()
        if actions.stop:
            raise NonFiniteTraining(
                f"iteration {self.iteration}: the loss or the gradients were not finite (Inf/NaN) for "
                f"{self.skipped_streak} consecutive iterations ({self.iteration - self.skipped_streak + 1}"
                f"-{self.iteration}); the optimizer skipped each, and training stops here without "
                "saving (the last checkpoint is untouched). Lower --lr or check the data, then "
                "resume with --load; --max-consecutive-skipped-iters sets the limit")
        if actions.save_withheld:
            log0(f"iteration {self.iteration}: not saving, the last {self.skipped_streak} "
                 "iteration(s) were skipped (Inf/NaN)")
        off_the_clock = actions.evaluate or actions.save
        if self.window.steps and off_the_clock:
            self.window.pause()
        if actions.evaluate:
            self.evaluate(may_stop=self.iteration < self.args.train_iters)
        if actions.save:
            self.save()
        if self.window.steps == 0:
            self.window.start()
        elif off_the_clock:
            self.window.resume()

    def train(self) -> None:
        """Iterations up to ``--train-iters``, then the final checkpoint; with the
        exit-signal handler, a save and ``StoppedBySignal`` once any rank has received
        a stop signal or lost its launcher (checked after every iteration but the
        last, after which the run completes, and between evaluation batches). Then
        (or on any error) the ``--save`` folder's lock is released."""
        try:
            with self.stop_signals if self.stop_signals is not None else contextlib.nullcontext():
                self.window.start()
                while self.iteration < self.args.train_iters:
                    actions = self.advance()
                    request = self.stop_requested() if self.iteration < self.args.train_iters else None
                    if request is not None:
                        self.stop(request, saved=actions.save)
                patch.drain()  # the last step's overlapped weight gathers: the weights are final
                # A signal from here on waits for the final save: the run is complete.
                if self.policy.saves_at_end(self.iteration):
                    self.save()
        finally:
            self.parts.release()  # the --save folder, for the next job

    def stop_requested(self) -> Optional[StopRequest]:
        """Collective (with the handler): what the ranks agree stops the run, if anything."""
        return self.stop_signals.agreed() if self.stop_signals is not None else None

    def stop(self, request: StopRequest, saved: bool) -> None:
        """Log the open window, save unless this iteration did (or its steps were
        skipped: the last checkpoint is then the last good one), and stop."""
        if self.window.steps:
            self.log_window()
        save = self.args.save
        if not save:
            outcome = "nothing saved (no --save)"
        elif self.skipped_streak:
            outcome = (f"not saved: its last {self.skipped_streak} iteration(s) were skipped (Inf/NaN), "
                       f"the latest checkpoint in {save} is the last good one; resume with --load {save}")
        else:
            if not saved:
                self.save()
            outcome = f"its checkpoint is saved in {save}; resume with --load {save}"
        raise StoppedBySignal(f"{request.describe(self.launcher)}: stopped after iteration {self.iteration}, "
                              f"{outcome}", request.exit_code_signum)

    # --- the policy's actions --------------------------------------------------------------

    def log_window(self) -> None:
        """One log record of the steps since the last one (waits for the device)."""
        loss_sum, window_steps, skipped, elapsed = self.window.close()
        # mean over the window's steps that were not skipped (NaN when none was) and
        # the data-parallel replicas (the last pipeline stage has the loss)
        stepped = window_steps - skipped
        self.last_loss = all_reduce_mean(loss_sum / stepped if stepped else math.nan,
                                         weight=float(is_loss_rank()))
        self.time_total += elapsed
        self.tokens_total += self.tokens_per_step * window_steps
        wire = self.meter.read()
        waits = self.waits.read()
        errors = patch.quantization_errors()
        shape = patch.gradient_group_shape()
        quantized = self.parts.quantized
        self.logger.log("train", {
            "iteration": self.iteration, "loss": self.last_loss,
            "lr": self.parts.optimizer.param_groups[0]["lr"],
            "grad_norm": float(self.grad_norm) if self.grad_norm is not None else math.nan,
            "step_time_s": elapsed / window_steps,
            "tokens_per_s": self.tokens_per_step * window_steps / elapsed,
            "bytes_sent": wire["sent"], "bytes_exact": wire["exact"],
            "bytes_sent_intra": wire["sent_intra"], "bytes_sent_inter": wire["sent_inter"],
            "wire_ratio": wire["sent"] / wire["exact"] if wire["exact"] else None,
            **{f"wait_{kind}_s": None if seconds is None else seconds / window_steps
               for kind, seconds in waits.items()},
            # sampled on the window's last step: none (null) when that step was
            # skipped or quantized nothing; 0 with quantization off
            "weight_quant_rel_error": errors.get("weight") if quantized else 0.0,
            # the gradients' last hop that ran: across nodes, or inside the one node
            "grad_quant_rel_error": errors.get("grad_inter", errors.get("grad_intra"))
            if quantized else 0.0,
            **{f"grad_{name}": shape.get(name) for name in (
                "crest_median", "crest_p99", "crest_max", "crest_share_above_8")},
            "grad_4bit_error_tlq": shape.get("error_tlq"),
            "grad_4bit_error_tlq_hs": shape.get("error_tlq_hs"),
            "skipped": skipped,
        })

    def evaluate(self, may_stop: bool = False) -> Optional[float]:
        """The validation loss, logged; with ``may_stop``, None when a stop was agreed
        between its batches (a long evaluation would outlast the launcher's grace
        period, and the checkpoint with it): nothing is logged, the stop follows."""
        parts = self.parts
        with says_out_of_memory(f"in the evaluation after iteration {self.iteration}",
                                self._lower_the_micro_batch()):
            loss = steps.evaluate(parts.ddp, self.args, parts.valid_ds, parts.layout, parts.num_microbatches,
                                  forward_step_func=self.forward_step,
                                  stop=self.stop_requested if may_stop and self.stop_signals is not None else None)
        if loss is None:
            log0(f"iteration {self.iteration}: evaluation cut short by the stop (not logged)")
            return None
        self.last_valid = loss
        self.logger.log("valid", {"iteration": self.iteration, "loss": self.last_valid})
        return self.last_valid

    def save(self) -> str:
        parts = self.parts
        extra = {"sdp4bit": patch.state_dict(parts.optimizer)}
        directory = checkpoint.save_checkpoint(self.args.save, self.iteration, parts.ddp, parts.optimizer,
                                               parts.scheduler, extra, data=parts.data.record(self.iteration))
        log0(f"saved checkpoint at iteration {self.iteration} to {self.args.save}")
        return directory

    # --- the end ---------------------------------------------------------------------------

    def summary(self) -> dict:
        """What the run did (on every rank; rank 0 also draws the loss curve)."""
        summary = {
            "iterations": self.iteration, "final_train_loss": self.last_loss,
            "final_valid_loss": self.last_valid, "no_evaluation": getattr(self.args, "no_evaluation", None),
            "tokens_per_s": self.tokens_total / self.time_total if self.time_total else math.nan,
            "bytes_sent": self.meter.totals["sent"], "bytes_exact": self.meter.totals["exact"],
            "metrics": self.logger.path, "run_dir": self.run_dir,
            "replica_checks_passed": patch.replica_checks_passed(),
            "check_interval": self.parts.config.check_interval,
            "layout": self.parts.layout.describe(), **parallel_ranks(),
        }
        self.logger.close()
        if is_rank0() and os.path.isfile(self.logger.path):
            summary["plot"] = self.plot()
        return summary

    def plot(self) -> Optional[str]:
        """The loss curve's PNG in the run folder; None without matplotlib, or when it
        cannot be written (said in one line: the run itself has completed)."""
        args, png = self.args, os.path.join(self.run_dir, "loss.png")
        try:
            return plot_losses(self.logger.path, png, title=f"GPT {args.num_layers}x{args.hidden_size}"
                               + (" with SDP4Bit" if self.parts.quantized else " (exact collectives)"))
        except OSError as error:
            log0(f"warning: the loss curve {png} could not be written ({error.strerror or error})")
            return None
