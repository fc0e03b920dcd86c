"""An async handle over several collectives, shaped like megatron's."""
from __future__ import annotations


class Handles:
    """Waits on several collective handles, like the coalescing manager's handle
    megatron keeps, then runs ``on_done`` once."""

    def __init__(self, handles, on_done=None):
        self.handles = [h for h in handles if h is not None]
        self.on_done = on_done

    def wait(self):
        for handle in self.handles:
            handle.wait()
        self.handles = []
        if self.on_done is not None:
            on_done, self.on_done = self.on_done, None
            on_done()
