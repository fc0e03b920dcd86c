"""A rank whose collective failed because another rank left the job.

When one rank stops (out of memory, killed, a refusal only it met), the others
are inside a collective with it. On gloo that collective fails at once with
``Connection closed by peer`` (``Connection reset by peer``, ``Broken pipe``):
a 40-line traceback on each of them, printed under the line of the rank that
failed first, which says why. ``lost_peer(error)`` turns it into ``LostPeer``, one
line per such rank that points at that one. (On NCCL the collective waits until
the launcher ends the rank: no traceback to replace.)
"""
from __future__ import annotations

import re
from typing import Optional

# gloo's words when the socket to a peer process closed under a collective
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote worker crashing")


class LostPeer(RuntimeError):
    """Another rank left during a collective; its own error says why."""


def lost_peer(error: BaseException) -> Optional[LostPeer]:
    """``LostPeer`` for a collective that failed because a peer process left, else None."""
    if not isinstance(error, RuntimeError) or isinstance(error, LostPeer):
        return None
    text = str(error)
    found = _PEER_GONE.search(text)
    if found is None:
        return None
    where = re.search(r"\[[0-9a-fA-F.:]+\]:\d+", text)
    return LostPeer(f"another rank left the job during a collective ({found.group(0)}"
                    f"{' ' + where.group(0) if where else ''}): the rank that failed first says why, above or in "
                    "the launcher's report")
