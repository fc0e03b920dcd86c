"""When the driver logs, evaluates, saves and stops: pure arithmetic of iterations.

Nothing here touches a model or a process group, so every rule is tested in one
process; the run object (``run.py``) asks ``after_step`` what to do after each
iteration and does it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Actions:
    """What to do after one iteration, in this order: log, stop, evaluate, save."""

    log: bool
    stop: bool
    """Too many consecutive skipped (Inf/NaN) iterations: stop without saving."""
    evaluate: bool
    save: bool
    save_withheld: bool = False
    """A scheduled save not made: the last iterations were skipped, so the weights
    are those of the last checkpoint's trouble (see ``after_step``)."""


@dataclass(frozen=True)
class StepPolicy:
    """The intervals of a run (Megatron-LM's flags), and the skipped-step limit."""

    train_iters: int
    log_interval: int
    eval_interval: int
    eval_iters: int = 1
    """Batches per evaluation; 0: no evaluation (Megatron-LM's meaning)."""
    save_interval: Optional[int] = None
    """None: no scheduled saves."""
    saving: bool = False
    """Whether the run saves at all (``--save``)."""
    max_consecutive_skipped: int = 3

    @classmethod
    def from_args(cls, args) -> "StepPolicy":
        return cls(train_iters=args.train_iters, log_interval=args.log_interval,
                   eval_interval=args.eval_interval, eval_iters=args.eval_iters,
                   save_interval=args.save_interval,
                   saving=bool(args.save), max_consecutive_skipped=args.max_consecutive_skipped_iters)

    def _scheduled_save(self, iteration: int) -> bool:
        return bool(self.saving and self.save_interval and iteration % self.save_interval == 0)

    def after_step(self, iteration: int, skipped_streak: int) -> Actions:
        """``iteration``: the one just trained (from 1); ``skipped_streak``: how many
        iterations in a row, this one included, the optimizer skipped."""
        last = iteration == self.train_iters
        stop = skipped_streak >= self.max_consecutive_skipped
        save = self._scheduled_save(iteration)
        # Skipped steps left the weights as they were; a checkpoint now could only
        # become the "latest" that a resume falls into the same trouble from.
        withheld = save and skipped_streak > 0
        return Actions(log=iteration % self.log_interval == 0 or last or stop, stop=stop,
                       evaluate=self.eval_iters > 0 and (iteration % self.eval_interval == 0 or last),
                       save=save and not withheld, save_withheld=withheld)

    def saves_at_end(self, iteration: int) -> bool:
        """Whether the run saves once more when the loop ends at ``iteration`` (when its
        last scheduled save was not there)."""
        return self.saving and not (self.save_interval and iteration % self.save_interval == 0)
