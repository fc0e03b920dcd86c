"""``Redirects``: a set of changes to megatron and torch that is on or off, with its state.

What the backend changes (``torch.cuda``'s functions, megatron's modules and classes)
exists once per process, so each kind of redirect has one ``Redirects`` object per
process (``core.BACKEND``, ``megatron_training.TRAINING``): it knows whether it is on
and holds the ``Patches`` that put everything back.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager, Iterator

from megatron_sdp4bit.patching import Patches


class Redirects:
    """On/off state and the changes made: ``enable()`` applies ``_apply()`` once (undoing
    all of it when that fails), ``disable()`` puts everything back; both idempotent."""

    marker = "__wrapped_by_cpu_backend__"
    """Attribute naming the original on every wrapper this object makes."""

    def __init__(self, label: str, hint: str) -> None:
        self.enabled = False
        self.patches = Patches(label, hint)

    def _apply(self) -> None:
        """Make every change through ``self.patches``."""
        raise NotImplementedError

    def enable(self) -> None:
        if self.enabled:
            return
        try:
            self._apply()
        except BaseException:
            self.patches.restore()
            raise
        self.enabled = True

    def disable(self) -> None:
        self.patches.restore()
        self.enabled = False

    @contextlib.contextmanager
    def enabled_inside(self) -> Iterator[None]:
        """Enabled inside the block, the previous state after."""
        was_enabled = self.enabled
        self.enable()
        try:
            yield
        finally:
            if not was_enabled:
                self.disable()

    def while_enabled(self, original: Callable, context: Callable[[], ContextManager]) -> Callable:
        """``original`` run inside ``context()`` while this is enabled, and as it is
        otherwise (a copy of the wrapper bound while enabled and kept after)."""

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            with context():
                return original(*args, **kwargs)

        setattr(wrapper, self.marker, original)
        return wrapper

    def marked(self, wrapper: Callable, original: Callable) -> Callable:
        """``wrapper`` named and documented as ``original``, and marked as this object's."""
        functools.update_wrapper(wrapper, original)
        setattr(wrapper, self.marker, original)
        return wrapper
