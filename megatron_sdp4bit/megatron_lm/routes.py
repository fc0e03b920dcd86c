"""Where the Megatron-LM routes hook Megatron-LM: one place, two moments.

The launcher and the patch in ``patches/`` both reach these, however they combine (a
patched tree run through the launcher reaches each twice; each acts once):

- ``before_initialize()``, from ``extend_args_provider``'s provider: Megatron-LM is
  parsing its flags, so ``initialize_megatron`` has not compiled its dataset helpers
  yet. The dataset-helpers plan (``dataset_helpers.py``) is applied here, or the job is
  refused in one line that says what to install; ``SDP4BIT_CPU=1`` outside the launcher
  (which alone can start the CPU mode) is refused; and Megatron-LM's own argument checks
  (``validate_args``, bare ``assert``\ s: a traceback on every rank) end the job in one
  line instead.
- ``after_parse(args, config)``, from ``install_from_args``, before the model is built:
  what would fail later is refused (``refusals.py``), then the layer's hooks in
  Megatron-LM's own checkpoint and log are installed (with or without ``--sdp4bit``: a
  run without it that resumes a checkpoint saved with it says so), and its
  ``--log-params-norm`` waits for the weight gathers (``weight_readers.py``).

Every refusal is one line from rank 0 and exit code 2, before the first iteration.
What is replaced in Megatron-LM is marked (``ROUTE_MARK``) and carries its ``Patches``,
so no module state records it and ``remove_megatron_lm_hooks`` can put it back.
"""
from __future__ import annotations

import argparse
import functools
import logging
from typing import Optional

from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.cpu_backend import ENV_VAR, cpu_training_requested, is_cpu_training_enabled
from megatron_sdp4bit.megatron_lm import checkpoint, dataset_helpers, reporting, weight_readers
from megatron_sdp4bit.megatron_lm.refusals import megatron_lm_refusal, refuse, refuse_before_training
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


def _refusing_assertions(validate_args):
    """Megatron-LM's ``validate_args``, its failed ``assert`` one line from rank 0 (exit 2)."""

    @functools.wraps(validate_args)
    def validate(*args, **kwargs):
        try:
            return validate_args(*args, **kwargs)
        except AssertionError as error:  # every rank validates the same flags
            refuse(megatron_lm_refusal(error))

    return validate


def before_initialize() -> None:
    """The dataset helpers for the Python running this job, and Megatron-LM's argument
    checks as one line (once per process)."""
    if cpu_training_requested() and not is_cpu_training_enabled():
        refuse(f"{ENV_VAR}=1 is read by the launcher only, which starts the CPU mode before Megatron-LM "
               f"is imported: run {ENV_VAR}=1 torchrun ... -m megatron_sdp4bit.launch "
               "path/to/pretrain_gpt.py <args> (patched or not), or unset it to run on GPUs")
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
    patches.set_everywhere(sites.validate_args, _refusing_assertions(sites.validate_args), "megatron.training")
    owner, name = sites.compile_helpers
    setattr(getattr(owner, name), ROUTE_MARK, patches)
    logger.debug("dataset helpers: %s (%s)", plan.how, plan.folder)


def after_parse(args: argparse.Namespace, config: Optional[SDP4BitConfig]) -> None:
    """Refuse what the run would die of later; then the layer's state into Megatron-LM's
    checkpoints (``checkpoint.py``) and its figures into Megatron-LM's log
    (``reporting.py``), once per process. Both look the layer up at each call: without it
    Megatron-LM saves and logs as it does."""
    sites = megatron_lm_sites()
    refuse_before_training(args, config, None if sites is None else sites.checkpoint_formats)
    if sites is None:
        return
    log_site = (sites.training, sites.training_log)
    if _hooked(log_site) is not None:
        return
    patches = Patches("megatron_sdp4bit.megatron_lm", hint="a checkpoint or log site moved in this release")
    checkpoint.install_checkpointing(sites, patches)
    reporting.install_reporting(sites, patches)
    weight_readers.install_weight_readers(sites, patches)
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
