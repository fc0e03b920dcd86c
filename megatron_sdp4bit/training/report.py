"""What the driver prints at the end of a run: the summary block."""
from __future__ import annotations


def _valid(loss) -> str:
    return "not evaluated (--eval-iters 0)" if loss is None else f"{loss:.4f}"


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
        f"final valid loss    {_valid(summary['final_valid_loss'])}",
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
