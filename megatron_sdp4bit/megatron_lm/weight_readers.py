"""Megatron-LM's read of the weights between the optimizer step and the next forward pass.

Under ``--overlap-param-gather`` the layer submits every weight gather right after the
optimizer step (``megatron/param_sync.py``), and until the forward pre-hooks wait on
them the weight buffers are being written, on a worker thread or a side stream.
Megatron-LM's ``train`` reads the weights exactly there when ``--log-params-norm`` is
given (``calc_params_l2_norm``: ``param.data`` in fp32 runs, and in bf16 runs whose
params carry no fp32 ``main_param``), so it would log the norm of half-written weights.
The wrapped function waits for the layer's collectives first (``patch.drain``); on the
steps it runs, the gathers then no longer overlap the forward pass, which one INFO line
says, once. (A checkpoint save and the weight-hash check go through megatron's forced
parameter sync, which waits on the gathers already.)
"""
from __future__ import annotations

import functools
import logging

from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.megatron.adapters.route_sites import RouteSites
from megatron_sdp4bit.patching import Patches

logger = logging.getLogger(__name__)


def _draining_first(norm):
    said = []  # this wrapper's own memory: the INFO line once per install

    @functools.wraps(norm)
    def calc_params_l2_norm(*args, **kwargs):
        if patch.is_installed():
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
    collectives before it reads the weights, until ``patches`` is restored."""
    patches.set(sites.training, sites.params_norm,
                _draining_first(getattr(sites.training, sites.params_norm)))
