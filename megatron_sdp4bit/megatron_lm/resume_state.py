"""Which SDP4Bit state each rank of a Megatron-LM resume takes, agreed by every rank.

``checkpoint.py`` saves one file per rank, ``<iteration folder>/sdp4bit/rank_<rank>.pt``
(the layer's state and the layout it was saved with). On ``--load`` each rank decides
from the files (``decide``), then the ranks compare their decisions (``agree``), so
that every rank acts on one outcome before any goes on:

- every rank found its state: each resumes with it;
- the checkpoint was saved without the layer (a stock run: its saved args ask for no
  quantization, and there is no ``sdp4bit/`` folder): the layer continues from
  Megatron-LM's iteration with fresh streams, said in one line;
- otherwise the job is refused in one line naming the first rank file that is missing
  or damaged, or the layout that cannot be resumed. Before, a rank whose own file was
  missing stopped alone (the others waited for it, then died in gloo), and a missing
  ``rank_00000.pt`` read as "saved without --sdp4bit": every rank dropped its intact
  state (exact fp32 main shards, rounding streams) and the losses left the straight run.

Another data-parallel size: the step count comes from rank 0's file, a rank the saved
run had keeps its streams, a new rank starts its streams from the seed; exact fp32 main
shards, or another model parallelism, cannot be cut to another size here (refused).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch

FOLDER = "sdp4bit"
"""The layer's sub-folder of a Megatron-LM iteration folder."""

Report = Tuple[str, Optional[str]]
"""What one rank decided: ("state" | "none" | "refused", the refusal's line or None)."""


class Refused(Exception):
    """This rank cannot resume: the one line that says why and what to do."""


def rank_file(iteration_folder: str, rank: int) -> str:
    return os.path.join(iteration_folder, FOLDER, f"rank_{rank:05d}.pt")


def _incomplete(path: str, how: str) -> Refused:
    return Refused(f"{path} is {how}: the checkpoint's SDP4Bit state is incomplete (a save that did not "
                   "finish, or a file lost since); load an earlier iteration (--ckpt-step), or resume "
                   "this one without --sdp4bit (exact collectives from Megatron-LM's saved weights)")


def _read(path: str) -> dict:
    """A rank file's ``{"layout", "state"}``; a missing, unreadable or malformed file is refused."""
    if not os.path.exists(path):
        raise _incomplete(path, "missing")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # a damaged file: torch's zip reader or unpickler
        raise _incomplete(path, f"unreadable ({str(error).splitlines()[0] if str(error) else type(error).__name__})") \
            from error
    if not (isinstance(saved, dict) and isinstance(saved.get("layout"), dict)
            and isinstance(saved.get("state"), dict)):
        raise _incomplete(path, "not an SDP4Bit state file")
    return saved


def _sizes(layout: dict) -> dict:
    return {key: value for key, value in layout.items() if key not in ("rank", "data_parallel_rank")}


def decide(folder: str, here: dict, saved_with_layer: Optional[bool]) -> Optional[dict]:
    """This rank's layer state from ``folder`` for the layout ``here`` (world and
    data-parallel sizes and ranks, model parallelism); None when the checkpoint holds
    none. ``saved_with_layer``: whether the checkpoint's saved args asked for
    quantization (None: it records no args). Raises ``Refused``."""
    first = rank_file(folder, 0)
    if not os.path.exists(first) and not os.path.isdir(os.path.join(folder, FOLDER)) and not saved_with_layer:
        return None  # saved without the layer
    saved = _read(first)
    layout = saved["layout"]
    if _sizes(layout) == _sizes(here):
        return _read(rank_file(folder, here["rank"]))["state"]
    main_shards = bool(saved["state"].get("main_shards"))
    if layout["model_parallel"] != here["model_parallel"] or main_shards:
        holds = "exact fp32 main shards" if main_shards else "model-parallel shards"
        raise Refused(
            f"{folder} was saved with {layout['world_size']} ranks (data-parallel {layout['data_parallel_size']}, "
            f"TP/PP/CP/EP {layout['model_parallel']}) and its SDP4Bit state holds {holds} for that layout; "
            f"this run has {here['world_size']} ranks (data-parallel {here['data_parallel_size']}, TP/PP/CP/EP "
            f"{here['model_parallel']}): resume with the saved sizes")
    had_this_rank = here["rank"] < layout["world_size"]
    rng = _read(rank_file(folder, here["rank"]))["state"]["rng"] if had_this_rank else {}
    return {"iteration": saved["state"]["iteration"], "rng": rng, "main_shards": {}}


def report(decision) -> Report:
    """What this rank tells the others: ``decision`` is its state (or None) or a ``Refused``."""
    if isinstance(decision, Refused):
        return ("refused", str(decision))
    return ("none", None) if decision is None else ("state", None)


def agree(folder: str, reports: Sequence[Report]) -> Optional[str]:
    """The one refusal every rank acts on (None: resume), from every rank's report, in rank order."""
    refused = [(rank, line) for rank, (kind, line) in enumerate(reports) if kind == "refused"]
    if refused:
        rank, line = refused[0]
        others = len(refused) - 1
        return line + (f" (rank {rank}; {others} other rank{'s' if others > 1 else ''} refused too)"
                       if others else "")
    kinds = [kind for kind, _ in reports]
    if "state" in kinds and "none" in kinds:
        found = [rank for rank, kind in enumerate(kinds) if kind == "state"]
        return (f"{folder}: ranks {found} found SDP4Bit state in it and the other ranks none: every rank must "
                "see the same checkpoint folder (a filesystem all nodes share)")
    return None
