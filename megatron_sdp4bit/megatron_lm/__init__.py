"""The Megatron-LM routes: SDP4Bit in Megatron-LM's own training scripts.

- ``launcher.py``: ``python -m megatron_sdp4bit.launch PATH/TO/pretrain_gpt.py ...``
  runs an unedited script with Megatron-LM's parser taught the ``--sdp4bit*`` flags
  (``SDP4BIT_CPU=1``: on CPU ranks, through ``megatron_sdp4bit.cpu_backend``);
- ``glue.py``: what both routes call, and what the patches in ``patches/`` import
  (``extend_args_provider``, ``install_from_args``, ``install_before_model``,
  ``wrap_parse_args``).

This package parses flags and installs the layer (``megatron_sdp4bit.megatron.patch``);
it holds no state and patches nothing but Megatron-LM's ``parse_args`` names. Nothing
of Megatron-LM is imported here.
"""
from megatron_sdp4bit.megatron_lm.glue import (extend_args_provider, install_before_model, install_from_args,
                                               wrap_parse_args)

__all__ = ["extend_args_provider", "install_before_model", "install_from_args", "wrap_parse_args"]
