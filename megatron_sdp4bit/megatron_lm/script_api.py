"""Glue for Megatron-LM's training scripts (``pretrain_gpt.py`` and friends).

Two routes, one set of helpers:
- the launcher (``python -m megatron_sdp4bit.launch pretrain_gpt.py ...``) wraps
  Megatron-LM's ``parse_args`` with ``wrap_parse_args`` and needs no edit of the
  user's tree;
- the patch in ``patches/`` (one per Megatron-LM tag) edits ``pretrain_gpt.py`` to
  pass ``extra_args_provider=extend_args_provider(...)`` and to install the layer:
  through ``install_before_model(model_provider)`` where the script hands
  ``pretrain`` a model provider (core_v0.16.1, core_v0.17.1), with
  ``install_from_args(args)`` right after ``parse_and_validate_args`` where it
  does not (core_v0.18.2, core_v0.19.0; the first DDP construction then runs the
  cross-rank config check).

Either way the SDP4Bit flags are parsed by Megatron-LM's own parser (they show
in ``args`` and in checkpoints' saved args) and the patch layer is installed
before the model is wrapped in DistributedDataParallel. The routes combine: a
patched tree run through the launcher adds the flags once and installs once.
What both routes hook in Megatron-LM besides the parser is ``routes.py``'s.
"""
from __future__ import annotations

import functools

from megatron_sdp4bit.flag_errors import report_bad_flag
from megatron_sdp4bit.megatron.args import SDP4BitFlagError, add_sdp4bit_args, config_from_args
from megatron_sdp4bit.megatron_lm import routes


def _has_sdp4bit_flags(parser) -> bool:
    """Whether another route's provider added the flags already (argparse refuses a
    second ``--sdp4bit``: "conflicting option string")."""
    return "--sdp4bit" in parser._option_string_actions


def extend_args_provider(extra_args_provider=None):
    """An ``extra_args_provider`` for Megatron-LM that also adds the SDP4Bit flags (once,
    however many routes wrap it). Megatron-LM calls it while parsing its flags, before
    it initializes: the moment ``routes.before_initialize`` needs."""

    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        routes.before_initialize()
        return parser if _has_sdp4bit_flags(parser) else add_sdp4bit_args(parser)

    return provider


def install_from_args(args):
    """Install the patch layer if the parsed args ask for SDP4Bit; return the config.

    A bad ``--sdp4bit*`` value ends the process as a bad flag does in argparse: one
    line (from rank 0 only, every rank parses the same flags) and exit code 2; so does
    a run the layer would refuse later (``routes.after_parse``). Calling it again with
    the same args (routes combined) changes nothing.
    """
    try:
        config = config_from_args(args)
    except SDP4BitFlagError as error:
        raise SystemExit(report_bad_flag(f"error: {error}")) from None
    routes.after_parse(args, config)
    if config is not None and config.enabled:
        from megatron_sdp4bit.megatron.patch import install

        install(config)
    return config


def wrap_parse_args(parse_args):
    """Wrap Megatron-LM's ``parse_args`` so it knows and acts on the SDP4Bit flags."""
    if getattr(parse_args, "_sdp4bit_wrapped", False):
        return parse_args

    @functools.wraps(parse_args)
    def wrapped(extra_args_provider=None, ignore_unknown_args=False):
        args = parse_args(extend_args_provider(extra_args_provider), ignore_unknown_args)
        install_from_args(args)
        return args

    wrapped._sdp4bit_wrapped = True
    return wrapped


def install_before_model(model_provider):
    """Wrap a Megatron-LM model provider so the layer is installed before the model
    is built (torch.distributed is initialized by then, so the cross-rank config
    check runs immediately)."""

    @functools.wraps(model_provider)
    def provider(*args, **kwargs):
        from megatron.training import get_args

        install_from_args(get_args())
        return model_provider(*args, **kwargs)

    return provider
