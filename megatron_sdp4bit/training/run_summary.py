"""What the driver prints at the end of a run: the summary block, or why it stopped."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Optional

import torch

from megatron_sdp4bit.flag_errors import LAUNCHER_GRACE_S


def _valid(loss, why: Optional[str]) -> str:
    return f"not evaluated ({why or 'no evaluation yet'})" if loss is None else f"{loss:.4f}"


def summary_lines(summary: dict) -> list:
    if summary["bytes_exact"]:
        ratio = summary["bytes_sent"] / summary["bytes_exact"]
        wire = (f"{summary['bytes_sent'] / 2**20:.2f} MiB vs {summary['bytes_exact'] / 2**20:.2f} MiB "
                f"with the exact all-gather and FP32 reduce-scatter ({ratio:.3f}x, {1 / ratio:.2f}x less)")
    else:
        wire = "not counted (bytes are counted for the distributed optimizer's collectives only)"
    lines = [
        "", "=== summary ===",
        f"iterations          {summary['iterations']}",
        f"final train loss    {summary['final_train_loss']:.4f}",
        f"final valid loss    {_valid(summary['final_valid_loss'], summary.get('no_evaluation'))}",
        f"tokens/s            {summary['tokens_per_s']:.0f}",
        f"bytes sent per rank {wire}",
        f"metrics             {summary['metrics']}",
    ]
    if summary.get("replica_checks_passed"):  # none with one replica or a short run
        lines.insert(-1, f"replica checks      {summary['replica_checks_passed']} passed "
                         f"(every {summary['check_interval']} steps, all data-parallel replicas "
                         "bit-identical)")
    if summary.get("plot"):
        lines.append(f"loss curve          {summary['plot']}")
    return lines


def print_summary(summary: dict) -> None:
    print("\n".join(summary_lines(summary)), flush=True)


# --- how a run ended ---------------------------------------------------------------------

def launcher_error_file(message: str, callstack: Optional[str] = None) -> None:
    """Give torchrun the reason: it names each failed rank's error file in its own
    report ("Root Cause ... traceback : ..."), which otherwise says only "To enable
    traceback see ..." at the end of its output, below ours."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    if callstack is None:
        data = {"message": message, "timestamp": int(time.time())}
    else:
        data = {"message": {"message": message,
                            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the report is a courtesy; the line on stderr is the message
        pass


def _rank() -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:  # a RANK that is no number: the error being reported says so
        return 0


def report_stop(kind: str, exc: BaseException, code: int, who: str = "rank 0") -> int:
    """One line on stderr and in torchrun's report (on stdout for code 0: a run with
    nothing to do); returns ``code``.

    ``who``: ``"rank 0"`` when every rank stopped alike with this error: rank 0
    alone says it, and the other ranks wait (a bounded time) for the launcher to stop
    them once rank 0 has exited (leaving first, they could have torchrun stop rank 0
    before it printed); ``"rank 0, now"``: the same without the wait (the launcher is
    stopping too); ``"each rank"``: every failing rank says it, naming itself.
    """
    line = f"sdp4bit-pretrain: {kind}: {exc}"
    stream = sys.stdout if code == 0 else sys.stderr  # 0: nothing went wrong
    if code:
        launcher_error_file(line)
    if who == "each rank":
        print(f"sdp4bit-pretrain: {kind} (rank {_rank()}): {exc}", file=stream, flush=True)
    elif _rank() == 0:
        print(line, file=stream, flush=True)
    elif who == "rank 0" and "TORCHELASTIC_ERROR_FILE" in os.environ:
        time.sleep(LAUNCHER_GRACE_S)
    return code


def report_crash(exc: BaseException) -> None:
    """An error no rule foresaw (a bug): its traceback goes to torchrun's report too."""
    launcher_error_file(f"{type(exc).__name__}: {exc}", traceback.format_exc())
