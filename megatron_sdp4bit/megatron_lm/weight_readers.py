"""Megatron-LM's read of the weights between the optimizer step and the next forward pass.

Under ``--overlap-param-gather`` the layer submits every weight gather right after the
optimizer step (``megatron/param_sync.py``), and until the forward pre-hooks wait on
them the weight buffers are being written, on a worker thread or a side stream.
Megatron-LM's ``train`` reads the weights exactly there when ``--log-params-norm`` is
given (``calc_params_l2_norm``: ``param.data`` in fp32 runs, and in bf16 runs whose
params carry no fp32 ``main_param``), so it would log the norm of half-written weights.
The wrapped function waits for the layer's collectives first (``patch.drain``) where it
would read them (``reads_param_data``); on those steps the gathers then no longer overlap
the forward pass, which one INFO line says, once. Megatron-LM computes the norm on every
iteration, so in a bf16 run, where every parameter carries its fp32 ``main_param`` (what
the distributed optimizer steps, which the gathers do not write), it does not wait: the
gathers keep overlapping the forward pass. (A checkpoint save and the weight-hash check
go through megatron's forced parameter sync, which waits on the gathers already.)
"""
from __future__ import annotations

import functools
import inspect
import logging

from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.megatron.adapters.route_sites import RouteSites
from megatron_sdp4bit.patching import Patches

logger = logging.getLogger(__name__)


def reads_param_data(model, bf16: bool, force_create_fp32_copy: bool = False) -> bool:
    """Whether Megatron-LM's ``calc_params_l2_norm`` reads ``param.data`` of ``model`` (a
    model chunk or a list of them), which the weight gathers write, rather than only each
    parameter's fp32 ``main_param``: it does in fp32 and fp16 runs, with a forced fp32 copy,
    and for a bf16 parameter without a ``main_param`` (Megatron-LM's ``_get_param_data``)."""
    if not bf16 or force_create_fp32_copy:
        return True
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return any(not hasattr(param, "main_param") for chunk in chunks for param in chunk.parameters())


def _draining_first(norm, get_args):
    said = []  # this wrapper's own memory: the INFO line once per install
    signature = inspect.signature(norm)

    @functools.wraps(norm)
    def calc_params_l2_norm(*args, **kwargs):
        call = signature.bind_partial(*args, **kwargs).arguments
        if patch.is_installed() and reads_param_data(
                call["model"], bool(getattr(get_args(), "bf16", False)),
                bool(call.get("force_create_fp32_copy", False))):
            patch.drain()
            if not said:
                said.append(True)
                logger.info("SDP4Bit: --log-params-norm reads the weights right after the "
                            "optimizer step; the layer waits for its weight gathers first, so "
                            "on those steps they do not overlap the forward pass")
        return norm(*args, **kwargs)

    return calc_params_l2_norm


def install_weight_readers(sites: RouteSites, patches: Patches) -> None:
    """``calc_params_l2_norm`` in Megatron-LM's training module waits for the layer's
    collectives before it reads the weights they write, until ``patches`` is restored."""
    patches.set(sites.training, sites.params_norm,
                _draining_first(getattr(sites.training, sites.params_norm), sites.get_args))
