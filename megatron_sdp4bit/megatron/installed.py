"""Which SDP4Bit layer is installed in this process: one record, ``INSTALLED``.

Why one object per process rather than a handle each caller keeps: what a layer
installs (its methods on megatron-core's classes) exists once per process, so whether
a layer is installed, and which, is a fact of the process, as the CPU backend's
``Redirects`` are; and on Megatron-LM's route no code of ours could keep a handle from
the install to the calls that need it (Megatron-LM's ``pretrain`` owns the flow and
calls our hooks; a patched tree run through the launcher installs twice). So the record
is this one object, owned here: ``patch.install`` and ``patch.uninstall`` are its only
writers, and the facade's other functions read it (an attribute read, where they used
to find the layer on megatron's class through the adapter at every call).
"""
from __future__ import annotations

from typing import Optional

from megatron_sdp4bit.megatron.layer import SDP4BitLayer


class InstalledLayer:
    """The installed layer (``layer``), or None; ``require`` for what cannot run without one."""

    def __init__(self) -> None:
        self.layer: Optional[SDP4BitLayer] = None

    def require(self, what: str) -> SDP4BitLayer:
        if self.layer is None:
            raise RuntimeError(f"{what} needs the SDP4Bit layer installed: call "
                               "megatron_sdp4bit.megatron.patch.install(config) first")
        return self.layer


INSTALLED = InstalledLayer()
"""This process's record (see the module docstring)."""
