"""Buffers a collective keeps from one call to the next.

A quantized collective needs send and receive buffers for every hop. Allocating
them on every call costs allocator work and, on a GPU, fragments the cache; the
reference fork allocates them once. A ``Workspace`` is that once: named byte
buffers that grow to the largest request and are then reused. The caller decides
how far one is shared, which is what makes reuse safe: a buffer may only be
handed to the next call once the collective that used it has completed. The
patch layer keeps one workspace per direction for every bucket: its runner
(``runner.py``) runs one collective after another, on one thread or one stream.

Inside one reduce-scatter the chunks of the pipeline take turns on two slots per
buffer: chunk i + 2 reuses chunk i's buffers, which are done by then (chunk i's
hops are waited before chunk i + 1's second hop starts; see ``gradients.py``).

A workspace also keeps the *plans* of the calls that use its buffers (views of
them and the kernels' worked-out arguments, ``reduce_scatter_plan.py``), per input
tensor: a plan lives while its input tensor does and while no buffer has moved
(a larger request replaces a buffer, and then every plan is dropped).
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, Tuple

import torch

from megatron_sdp4bit.comm.buffer_names import SLOTS


class Workspace:
    """Named uint8 buffers, each as large as the largest request made for its name, and
    the plans made over them."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[str, str], torch.Tensor] = {}
        self._plans: Dict[int, tuple] = {}  # id(input) -> (weakref to it, {key: plan})
        self._next_slot: Dict[str, int] = {}

    def next_slots(self, kind: str, count: int) -> int:
        """The first of ``count`` consecutive slot numbers for a call of ``kind``: the one
        after the previous such call's last, so that two calls in a row start and end on
        different slots (``buffer_names``: a slot is its number modulo ``SLOTS``)."""
        first = self._next_slot.get(kind, 0)
        self._next_slot[kind] = (first + count) % SLOTS
        return first

    def buffer(self, name: str, nbytes: int, device) -> torch.Tensor:
        """A 1-D uint8 tensor of ``nbytes`` on ``device``: the start of the buffer kept
        under ``name`` (a larger request replaces it, and drops every plan; contents are
        undefined)."""
        key = (name, str(torch.device(device)))
        kept = self._buffers.get(key)
        if kept is None or kept.numel() < nbytes:
            kept = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._buffers[key] = kept
            self._plans.clear()
        return kept[:nbytes]

    def plan(self, input: torch.Tensor, key: tuple, build: Callable[[], object]):
        """The plan kept for ``input`` under ``key``, or ``build()``'s, kept from now on.
        ``key`` must tell apart everything else the plan depends on. The plan must not
        hold ``input`` itself (views of ``input.detach()`` do not), or it would keep it
        alive: it is dropped when ``input`` is."""
        entry = self._plans.get(id(input))
        if entry is not None and entry[0]() is input and key in entry[1]:
            return entry[1][key]
        plan = build()  # its buffer requests may drop the plans made so far
        entry = self._plans.get(id(input))
        if entry is None or entry[0]() is not input:
            ident, me = id(input), weakref.ref(self)  # no cycle through the callback

            def forget(ref) -> None:
                workspace = me()
                if workspace is not None and workspace._plans.get(ident, (None,))[0] is ref:
                    del workspace._plans[ident]

            entry = self._plans[ident] = (weakref.ref(input, forget), {})
        entry[1][key] = plan
        return plan

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(buffer.numel() for buffer in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
        self._plans.clear()
