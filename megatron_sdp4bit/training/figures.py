"""What every loss figure of the project shares: matplotlib without a display, and
the finish (grids, legends, layout, the PNG written, the figure freed).

matplotlib is optional: ``pyplot()`` is None without it, and callers then draw nothing.
"""
from __future__ import annotations

from typing import Iterable, Optional


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed), or None without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, axes: Iterable, path: str, dpi: int) -> str:
    """Give each of ``axes`` a light grid and its legend, write ``fig`` to ``path`` and
    close it (pyplot keeps every open figure otherwise); returns ``path``."""
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt  # imported already: fig came from it

    plt.close(fig)
    return path


def axis_labels(axis, x: str, y: str, title: Optional[str] = None) -> None:
    axis.set_xlabel(x)
    axis.set_ylabel(y)
    if title is not None:
        axis.set_title(title)
