"""Worst-case error of the quantized collectives, derived from the scales.

The collectives' error contract, as arithmetic a caller can evaluate: the CPU tests
assert it on every case, and ``python -m megatron_sdp4bit.diagnostics.device_collectives``
asserts it on a machine's own devices. Stated bound: A symmetric quantizer with scale
``s = absmax(group) / (2^(b-1) - 1)`` and stochastic rounding moves each value
by less than ``s`` (nearest: at most ``s/2``). Hence for rank r's output element i:

- one level over P ranks:   |err_i| <= sum_p s1[p, g(i)]
- two levels (N nodes of L): |err_i| <= sum_p s1[p, g1(i)] + sum_n s2[n, g2(i)],
  where s2 is the scale of node n's partial sum after the first hop, bounded
  by (absmax of the true partial sum + the first hop's error on it) / qmax2;
- with the Hadamard transform the scales are those of H x, and the inverse
  H / B maps a per-element error bound e to at most mean(e over the block).

``x`` is pre-scaled by 1/P for AVG. ``tolerance`` adds a small fp32-arithmetic
slack and, for bf16 outputs, bf16's rounding (2^-8 relative). The Hadamard
matrix here is built by Sylvester's doubling and nothing here imports ``quant``:
the bound is independent of the code it checks.
"""
from __future__ import annotations


import torch


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def sylvester_hadamard(size: int) -> torch.Tensor:
    """The unnormalised +-1 Hadamard matrix: H_2n = [[H, H], [H, -H]]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _group_max(values: torch.Tensor, group: int) -> torch.Tensor:
    """Each element replaced by the max of its group along the last dim (length % group == 0)."""
    shape = values.shape
    grouped = values.reshape(*shape[:-1], shape[-1] // group, group)
    return grouped.amax(-1, keepdim=True).expand_as(grouped).reshape(shape)


def hop_levels(num_nodes: int, per_node: int) -> list[str]:
    """The hops the collective uses for this shape: two levels, or one node's, or one across."""
    if num_nodes > 1 and per_node > 1:
        return ["intra", "inter"]
    return ["intra"] if num_nodes == 1 else ["inter"]


def reduce_scatter_bound(inputs: torch.Tensor, shard_index: int, config, num_nodes: int,
                         average: bool) -> torch.Tensor:
    """Per-element error bound of shard ``shard_index`` of the quantized reduce-scatter.

    ``inputs`` is [P, P*s] fp32: every DP rank's input, in DP-group order; DP
    rank p sits on node p // (P / num_nodes).
    """
    dp = inputs.shape[0]
    shard = inputs.shape[1] // dp
    per_node = dp // num_nodes
    levels = hop_levels(num_nodes, per_node)
    formats = [config.grad_hop_format(level) for level in levels]
    block = config.grad_hadamard_block
    align = config.grad_alignment(levels)
    padded = -(-shard // align) * align
    y = torch.zeros(dp, padded, dtype=torch.float64)
    y[:, :shard] = inputs[:, shard_index * shard:(shard_index + 1) * shard].double()
    if average:
        y /= dp
    if block:
        h = sylvester_hadamard(block)
        y = (y.view(dp, -1, block) @ h).view(dp, padded)
    bits1, group1 = formats[0]
    s1 = _group_max(y.abs(), group1) / qmax(bits1)
    if len(formats) == 1:
        bound = s1.sum(0)
    else:
        bits2, group2 = formats[1]
        partial = y.view(num_nodes, per_node, padded).sum(1)
        first_error = s1.view(num_nodes, per_node, padded).sum(1)
        s2 = (_group_max(partial.abs(), group2) + _group_max(first_error, group2)) / qmax(bits2)
        bound = first_error.sum(0) + s2.sum(0)
    if block:
        bound = bound.view(-1, block).mean(-1, keepdim=True).expand(-1, block).reshape(-1)
    return bound[:shard]


def tolerance(bound: torch.Tensor, reference: torch.Tensor, inputs_scale: float,
              dtype: torch.dtype) -> torch.Tensor:
    """The bound plus fp32 slack, plus bf16 rounding of the output when it is bf16."""
    tol = bound * 1.001 + 1e-5 * inputs_scale
    if dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * (reference.abs().double() + bound)
    return tol


def weight_bound(target: torch.Tensor, source: torch.Tensor, bits: int, group: int,
                 model_dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on |model_new - main| for one shard after a quantized gather.

    ``source`` is what was quantized (main - model for qWD, main for qW);
    ``target`` the main shard (for the bf16 rounding term).
    """
    n = source.numel()
    padded = -(-n // group) * group
    values = torch.zeros(padded, dtype=torch.float64)
    values[:n] = source.double()
    bound = (_group_max(values.abs(), group) / qmax(bits))[:n]
    # fp32 slack, and the model buffer's own rounding (bf16: 2^-8 relative).
    unit = 2.0 ** -8 if model_dtype == torch.bfloat16 else 2.0 ** -23
    return bound * 1.001 + unit * (target.abs().double() + bound) + 1e-7
