"""Where the driver's numbers go: console, metrics.jsonl, TensorBoard, loss plot.

Only the logging rank writes. Every record is one JSON object per line in
``<run-dir>/metrics.jsonl`` (``kind`` is ``train`` or ``valid``), so a run can be
read back with ``read_metrics``; TensorBoard events are written when tensorboard
is installed; ``plot_losses`` draws the loss curve with matplotlib.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional

from megatron_sdp4bit.megatron.group_handle import waited_text
from megatron_sdp4bit.training.figures import axis_labels, pyplot, save_figure

TRAIN_FIELDS = (
    "iteration", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
    "bytes_sent", "bytes_exact", "bytes_sent_intra", "bytes_sent_inter", "wire_ratio",
    "wait_reduce_scatter_s", "wait_all_gather_s",
    "weight_quant_rel_error",
    "grad_quant_rel_error", *(f"grad_{name}" for name in (
        "crest_median", "crest_p99", "crest_max", "crest_share_above_8",
        "4bit_error_tlq", "4bit_error_tlq_hs")),
    "skipped",
)
"""What a ``train`` record holds. The ``grad_crest_*`` and ``grad_4bit_error_*`` fields
are the gradients' 4-bit group shape on the window's sampled step
(``patch.gradient_group_shape``): null where no gradient was quantized. ``wait_*_s``:
seconds per step the logging rank's training thread waited on the layer's overlapped
reduce-scatters and all-gathers (``patch.collective_waits``: the communication the
overlap left exposed); null where none was timed (that direction not overlapped, or
not on gloo's worker thread: on NCCL's side stream the host does not wait)."""


def default_run_dir() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def summary_writer_class():
    """torch's TensorBoard writer, or None: tensorboard is an optional package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


def _check_folder(flag: str, folder: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        blocking = next((path for path in _parents(folder) if os.path.isfile(path)), None)
        why = f"{blocking} is a file" if blocking else error.strerror or str(error)
        raise ValueError(f"{flag} {folder} cannot be written ({why}): the run's metrics go there; "
                         f"pass a {flag} you can write") from None


def _parents(folder: str) -> list:
    """``folder`` and the folders above it."""
    path, paths = os.path.abspath(folder), []
    while path not in paths:
        paths.append(path)
        path = os.path.dirname(path)
    return paths


def check_run_folders(run_dir: str, tensorboard_dir: Optional[str]) -> None:
    """Before training, on the logging rank: the folders ``MetricsLogger`` writes can be
    written, and a ``--tensorboard-dir`` can be served; else ``ValueError`` naming the
    flag (at the first log line it was a traceback of that rank alone, and a
    ``--tensorboard-dir`` without tensorboard installed was ignored)."""
    _check_folder("--run-dir", run_dir)
    if summary_writer_class() is None:
        if tensorboard_dir is not None:
            raise ValueError(f"--tensorboard-dir {tensorboard_dir}: tensorboard is not installed, so no events "
                             "would be written there; install it (pip install tensorboard), or drop "
                             "--tensorboard-dir (--run-dir's metrics.jsonl holds every value)")
        return
    _check_folder("--tensorboard-dir" if tensorboard_dir else "--run-dir",
                  tensorboard_dir or os.path.join(run_dir, "tensorboard"))


def set_aside_later_records(path: str, start_iteration: int) -> Optional[str]:
    """Records of ``path`` past ``start_iteration`` belong to a run this one replaces (an
    earlier run in the same ``--run-dir``, or the steps after the checkpoint a resume
    starts from): appended to, the file would hold two runs' iterations, and the loss
    plot would draw them as one curve. They go to ``metrics.replaced-<time>.jsonl``
    beside it (returned; None when there were none)."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]

    def kept(line: str) -> bool:
        try:
            return json.loads(line)["iteration"] <= start_iteration
        except (ValueError, KeyError, TypeError):  # a line cut short by a crash
            return False

    keep = [line for line in lines if kept(line)]
    if len(keep) == len(lines):
        return None
    aside = os.path.join(os.path.dirname(path), f"metrics.replaced-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    with open(aside, "a", encoding="utf-8") as f:
        f.writelines(line for line in lines if not kept(line))
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)
    return aside


class MetricsLogger:
    def __init__(self, run_dir: str, enabled: bool, total_iters: int,
                 progress_bar: bool = True, tensorboard_dir: Optional[str] = None, start_iteration: int = 0):
        self.enabled = enabled
        self.run_dir = run_dir
        self.total_iters = total_iters
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._progress = progress_bar and enabled and sys.stdout.isatty()
        self._file = None
        self._tb = None
        self._started = time.time()
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        aside = set_aside_later_records(self.path, start_iteration)
        if aside is not None:
            whose = ("an earlier run's records, and this run starts from scratch" if start_iteration == 0 else
                     f"records past iteration {start_iteration}, where this run resumes (steps trained after "
                     "its checkpoint, or another run's)")
            print(f"{self.path} held {whose}: they are moved to {aside}", flush=True)
        self._file = open(self.path, "a", encoding="utf-8")
        SummaryWriter = summary_writer_class()
        if SummaryWriter is not None:
            self._tb = SummaryWriter(tensorboard_dir or os.path.join(run_dir, "tensorboard"))

    def log(self, kind: str, record: dict) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, **record}
        self._write(kind, record)
        self._print(kind, record)

    def _write(self, kind: str, record: dict) -> None:
        """The record into metrics.jsonl and TensorBoard. A disk that fills up (or a
        folder that goes away) stops the files, said once, not the run: a traceback
        here ended the logging rank, and the others with it, losing every step since
        the last checkpoint."""
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self._tb is not None:
                for key, value in record.items():
                    if isinstance(value, (int, float)) and key != "iteration" and math.isfinite(value):
                        self._tb.add_scalar(f"{kind}/{key}", value, record["iteration"])
        except OSError as error:
            print(f"warning: iteration {record['iteration']}: writing the metrics in {self.run_dir} failed "
                  f"({error.strerror or error}); training goes on, its log lines below are the only record",
                  file=sys.stderr, flush=True)
            self.close()
            self._file = self._tb = None

    def _print(self, kind: str, r: dict) -> None:
        if kind == "train":
            wire = (f"wire {r['wire_ratio']:.3f}x of exact" if r["wire_ratio"] is not None
                    else "wire not counted")
            line = (f"iter {r['iteration']:>6}/{self.total_iters} | loss {r['loss']:.4f} | "
                    f"lr {r['lr']:.2e} | grad norm {r['grad_norm']:.3f} | "
                    f"{r['step_time_s'] * 1000:.0f} ms/step | {r['tokens_per_s']:.0f} tok/s | {wire}")
            line += waited_text(r.get("wait_reduce_scatter_s"), r.get("wait_all_gather_s"), "step")
            if r.get("skipped"):
                line += f" | skipped {r['skipped']} (Inf/NaN)"
        else:
            line = f"iter {r['iteration']:>6}/{self.total_iters} | validation loss {r['loss']:.4f}"
        if self._progress:
            done = r["iteration"] / max(self.total_iters, 1)
            bar = "#" * int(done * 20) + "-" * (20 - int(done * 20))
            line = f"[{bar}] {line}"
        print(line, flush=True)

    def close(self) -> None:
        for stream in (self._file, self._tb):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # (its error was said when writing)
                    pass


def read_metrics(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def loss_curves(metrics_path: str) -> dict:
    """``{"train": [(iteration, loss), ...], "valid": [...]}`` of a run's metrics.jsonl."""
    records = read_metrics(metrics_path)
    return {kind: [(r["iteration"], r["loss"]) for r in records if r["kind"] == kind]
            for kind in ("train", "valid")}


GROUP_SHAPE_FIELDS = ("grad_crest_median", "grad_crest_p99", "grad_crest_share_above_8",
                      "grad_4bit_error_tlq", "grad_4bit_error_tlq_hs")


def group_shape_means(metrics_path: str, after_iteration: int = 0) -> dict:
    """Per ``GROUP_SHAPE_FIELDS`` field, its mean over the sampled train records past
    ``after_iteration`` and how many there were (``samples``); {} when none was sampled
    (no gradient quantized, or a run from before the field existed)."""
    records = [r for r in read_metrics(metrics_path) if r["kind"] == "train"
               and r["iteration"] > after_iteration and r.get("grad_crest_p99") is not None]
    if not records:
        return {}
    means = {field: sum(r[field] for r in records) / len(records) for field in GROUP_SHAPE_FIELDS}
    return {**means, "samples": len(records)}


def plot_losses(metrics_path: str, png_path: str, title: str = "",
                reference: Optional[dict] = None, label: str = "",
                reference_label: str = "reference") -> Optional[str]:
    """Train and validation loss against iteration, drawn over ``reference``'s curves
    (``{"train": [[it, loss], ...], "valid": [...]}``) when given; returns the PNG path
    (None without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None
    runs = [(label, loss_curves(metrics_path), {})]
    if reference is not None:
        runs = [(reference_label, reference, dict(color="0.45")),
                (label, runs[0][1], dict(color="tab:blue"))]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curves, style in runs:
        prefix = f"{name}: " if name else ""
        if curves["train"]:
            ax.plot(*zip(*curves["train"]), label=prefix + "train", **style)
        if curves["valid"]:
            ax.plot(*zip(*curves["valid"]), "o-", label=prefix + "validation", **style)
    axis_labels(ax, "iteration", "loss", title)
    return save_figure(fig, [ax], png_path, dpi=120)
