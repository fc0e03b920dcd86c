"""The Megatron-LM routes: SDP4Bit in Megatron-LM's own training scripts.

- ``launcher.py``: ``python -m megatron_sdp4bit.launch PATH/TO/pretrain_gpt.py ...``
  runs an unedited script with Megatron-LM's parser taught the ``--sdp4bit*`` flags
  (``SDP4BIT_CPU=1``: on CPU ranks, through ``megatron_sdp4bit.cpu_backend``);
- ``script_api.py``: what both routes call, and what the patches in ``patches/`` import
  (``extend_args_provider``, ``install_from_args``, ``install_before_model``,
  ``wrap_parse_args``);
- ``routes.py``: the one place both routes hook Megatron-LM beyond its parser: the
  dataset helpers for the running Python (``dataset_helpers.py``) while the flags are
  parsed, then what would fail later refused (``refusals.py``), one line from rank 0.

This package parses flags and installs the layer (``megatron_sdp4bit.megatron.patch``);
it holds no state (what it replaces in Megatron-LM carries its own ``Patches``), and
reaches Megatron-LM's internals only through the adapter's ``RouteSites``. Nothing of
Megatron-LM is imported at import time.
"""
from megatron_sdp4bit.megatron_lm.script_api import (extend_args_provider, install_before_model, install_from_args,
                                               wrap_parse_args)

__all__ = ["extend_args_provider", "install_before_model", "install_from_args", "wrap_parse_args"]
