"""Where the Megatron-LM routes hook Megatron-LM: one place, two moments.

The launcher and the patch in ``patches/`` both reach these, however they combine (a
patched tree run through the launcher reaches each twice; each acts once):

- ``before_initialize()``, from ``extend_args_provider``'s provider: Megatron-LM is
  parsing its flags, so ``initialize_megatron`` has not compiled its dataset helpers
  yet. The dataset-helpers plan (``dataset_helpers.py``) is applied here, or the job is
  refused in one line that says what to install.
- ``after_parse(args, config)``, from ``install_from_args``, before the model is built:
  what would fail later is refused (``refusals.py``), then the layer's hooks in
  Megatron-LM's own checkpoint and log are installed.

Every refusal is one line from rank 0 and exit code 2, before the first iteration.
What is replaced in Megatron-LM is marked (``ROUTE_MARK``) and carries its ``Patches``,
so no module state records it and ``remove_megatron_lm_hooks`` can put it back.
"""
from __future__ import annotations

import argparse
import logging
from typing import Optional

from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.megatron_lm import checkpoint, dataset_helpers, reporting
from megatron_sdp4bit.megatron_lm.refusals import refuse, refuse_before_training
from megatron_sdp4bit.patching import Patches

logger = logging.getLogger(__name__)

ROUTE_MARK = "__sdp4bit_route_patches__"
"""Attribute of what the routes put in Megatron-LM: the ``Patches`` that put it there."""


def megatron_lm_sites():
    """The adapter's ``RouteSites``, or None where ``megatron.training`` is not importable
    (not a Megatron-LM run: nothing to hook). An unsupported release is refused."""
    try:
        import megatron.training  # noqa: F401  (only to ask whether Megatron-LM is here)
    except ImportError:
        return None
    from megatron_sdp4bit.megatron.adapters import current_adapter

    try:
        adapter = current_adapter()
    except RuntimeError as error:  # a release without an adapter, not forced
        refuse(str(error))
    return adapter.megatron_lm_sites()


def _hooked(site) -> Optional[Patches]:
    owner, name = site
    return getattr(getattr(owner, name, None), ROUTE_MARK, None)


def before_initialize() -> None:
    """The dataset helpers for the Python running this job (once per process)."""
    sites = megatron_lm_sites()
    if sites is None or _hooked(sites.compile_helpers) is not None:
        return
    from megatron_sdp4bit.megatron.adapters import current_adapter

    try:
        plan = dataset_helpers.plan_dataset_helpers(current_adapter().dataset_helpers_module)
    except dataset_helpers.HelpersUnavailable as error:
        refuse(str(error))
    patches = Patches("megatron_sdp4bit.megatron_lm", hint="the dataset helpers' site moved in this release")
    dataset_helpers.use_dataset_helpers(plan, sites.compile_helpers, patches)
    owner, name = sites.compile_helpers
    setattr(getattr(owner, name), ROUTE_MARK, patches)
    logger.debug("dataset helpers: %s (%s)", plan.how, plan.folder)


def after_parse(args: argparse.Namespace, config: Optional[SDP4BitConfig]) -> None:
    """Refuse what the run would die of later; then, for an SDP4Bit run, the layer's
    state into Megatron-LM's checkpoints (``checkpoint.py``) and its figures into
    Megatron-LM's log (``reporting.py``), once per process."""
    sites = megatron_lm_sites()
    refuse_before_training(args, config, None if sites is None else sites.checkpoint_formats)
    if sites is None or config is None or not config.enabled:
        return
    log_site = (sites.training, sites.training_log)
    if _hooked(log_site) is not None:
        return
    patches = Patches("megatron_sdp4bit.megatron_lm", hint="a checkpoint or log site moved in this release")
    checkpoint.install_checkpointing(sites, patches)
    reporting.install_reporting(sites, patches)
    setattr(getattr(*log_site), ROUTE_MARK, patches)


def remove_megatron_lm_hooks() -> None:
    """Put back what ``before_initialize`` and ``after_parse`` replaced (tests; a job
    keeps them to its end), the later first."""
    sites = megatron_lm_sites()
    if sites is None:
        return
    for site in ((sites.training, sites.training_log), sites.compile_helpers):
        patches = _hooked(site)
        if patches is not None:
            patches.restore()
