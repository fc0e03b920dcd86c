"""The quantization API's argument contract, written once for both backends.

Every op of ``reference.py`` (the specification) and of ``triton_ops.py`` is
decorated with ``api_op``: the call's arguments are bound by the reference's
signature (its defaults included), checked by the op's contract below, and
passed to the backend's body in the signature's order. So a bad argument gets
the same ``ValueError`` from either backend, and neither body repeats a check.
What only one backend cannot do (the Triton kernels need CUDA tensors, a
contiguous ``base`` to add into) stays in that backend.

Binding builds a dict from the parameter names: 2-4 us a call on the 2-core
development VM under load, where ``inspect.Signature.bind`` took 18-35 us (the
collectives issue tens of ops a step).

``op.prepare(*args, **kwargs)`` binds and checks a call once and returns
``run(generator=None)``, which makes the same call again on the same tensors (a
fresh ``generator`` each time: the one thing that changes from step to step). A
collective that issues the same calls every step prepares them once
(``comm/reduce_scatter_plan.py``): pass it contiguous tensors of a dtype the kernels
read, and ``out=``, since a backend that has to copy an input, or allocates the
result, does so once, at prepare. A backend whose body is ``planned`` returns ``(result,
launch)`` and leaves the launch to ``launch(generator)``, so that everything the
body works out (the Triton ops: strides, tiling, kernel variant) is worked out once.
"""
from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace
from typing import Any, Callable, Dict, Optional

import torch

from megatron_sdp4bit.quant.types import (
    check_format,
    check_hadamard_block,
    check_hadamard_chunks,
    check_out,
    check_out_chunks_whole,
    check_quantized,
    check_rows,
    check_same_numel,
    chunks_to_sum,
)


def same_device(*tensors: Optional[torch.Tensor]) -> None:
    """Every given tensor on the first one's device."""
    present = [t for t in tensors if t is not None]
    for t in present[1:]:
        if t.device != present[0].device:
            raise ValueError(f"tensors are on different devices: {present[0].device} and {t.device}")


def _check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, not {type(generator).__name__}")


def _check_producer(a: SimpleNamespace, numel: int, device: torch.device) -> None:
    """The format, generator and ``out`` of an op that writes a QuantizedTensor."""
    check_format(a.bits, a.group_size, a.rounding)
    _check_generator(a.generator)
    if a.out is not None:
        check_out(a.out, numel, a.bits, a.group_size, device)


def _out_codes(a: SimpleNamespace) -> Optional[torch.Tensor]:
    return None if a.out is None else a.out.codes


# --- one contract per op -----------------------------------------------------------------

def _quantize(a: SimpleNamespace) -> None:
    _check_producer(a, a.x.numel(), a.x.device)


def _dequantize(a: SimpleNamespace) -> None:
    check_quantized(a.q)


def _quantize_weight_diff(a: SimpleNamespace) -> None:
    check_same_numel("main shard", a.main_shard, "model shard", a.model_shard.numel())
    same_device(a.main_shard, a.model_shard)
    _check_producer(a, a.main_shard.numel(), a.main_shard.device)


def _dequantize_add_(a: SimpleNamespace) -> None:
    check_quantized(a.q)
    check_same_numel("base", a.base, "the quantized tensor", a.q.numel)
    same_device(a.base, a.q.codes)


def _hadamard_quantize(a: SimpleNamespace) -> None:
    _check_producer(a, a.x.numel(), a.x.device)
    chunk_numel = a.x.numel() if a.out is None else a.out.chunk_numel
    check_hadamard_chunks(chunk_numel, a.group_size, a.hadamard_block)


def _hadamard_quantize_rows(a: SimpleNamespace) -> None:
    check_format(a.bits, a.group_size, a.rounding)  # first: check_rows divides by the group size
    check_rows(a.rows, a.order, a.start, a.valid, a.padded, a.group_size, a.hadamard_block)
    _check_generator(a.generator)
    if a.out is not None:
        check_out(a.out, a.rows.shape[0] * a.padded, a.bits, a.group_size, a.rows.device)
        check_out_chunks_whole(a.out, a.group_size)


def _dequantize_sum_requantize(a: SimpleNamespace) -> None:
    check_quantized(a.q)
    chunk = chunks_to_sum(a.q, a.num_chunks)
    _check_producer(a, chunk, a.q.device)
    if a.out is not None:
        check_out_chunks_whole(a.out, a.group_size, a.q.group_size)


def _dequantize_sum(a: SimpleNamespace) -> None:
    check_quantized(a.q)
    chunk = chunks_to_sum(a.q, a.num_chunks)
    block = a.inverse_hadamard_block
    if block is not None:
        check_hadamard_block(block)
        if chunk % block:
            raise ValueError(
                f"hadamard_transform: {chunk} elements is not a multiple of block={block}; "
                "pad the input to a multiple of the block"
            )
    if a.out is not None:
        if a.out.numel() != chunk:
            raise ValueError(f"out has {a.out.numel()} elements, the sum has {chunk}")
        same_device(a.out, a.q.codes)


CONTRACTS: Dict[str, Callable[[SimpleNamespace], None]] = {
    "quantize": _quantize,
    "dequantize": _dequantize,
    "quantize_weight_diff": _quantize_weight_diff,
    "dequantize_add_": _dequantize_add_,
    "hadamard_quantize": _hadamard_quantize,
    "hadamard_quantize_rows": _hadamard_quantize_rows,
    "dequantize_sum_requantize": _dequantize_sum_requantize,
    "dequantize_sum": _dequantize_sum,
}
"""The checks of each op of the API, by name."""


# --- binding -------------------------------------------------------------------------------

def _bind(op: str, names: tuple, defaults: Dict[str, Any], args: tuple,
          kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The call's arguments by name, with Python's own errors for a wrong call."""
    if len(args) > len(names):
        raise TypeError(f"{op}() takes {len(names)} arguments but {len(args)} were given")
    bound = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in defaults and name not in names:
            raise TypeError(f"{op}() got an unexpected keyword argument {name!r}")
        if name in bound:
            raise TypeError(f"{op}() got multiple values for argument {name!r}")
        bound[name] = value
    if len(bound) < len(names):
        for name in names:
            if name not in bound:
                if name not in defaults:
                    raise TypeError(f"{op}() missing required argument {name!r}")
                bound[name] = defaults[name]
    return bound


def api_op(specification: Optional[Callable] = None,
           planned: bool = False) -> Callable[[Callable], Callable]:
    """Decorate a backend's body of an API op (see the module docstring).

    ``specification``: the reference op whose signature the body implements (the
    body takes every argument positionally, in that order); None for the
    reference's own ops. ``planned``: the body returns ``(result, launch)`` and
    ``launch(generator)`` does the work.
    """

    def decorate(body: Callable) -> Callable:
        spec = specification or body
        signature = inspect.signature(spec)
        names = tuple(signature.parameters)
        defaults = {name: p.default for name, p in signature.parameters.items()
                    if p.default is not inspect.Parameter.empty}
        contract = CONTRACTS[spec.__name__]

        def checked(args, kwargs) -> Dict[str, Any]:
            bound = _bind(spec.__name__, names, defaults, args, kwargs)
            contract(SimpleNamespace(**bound))
            return bound

        @functools.wraps(body)
        def op(*args, **kwargs):
            bound = checked(args, kwargs)
            if not planned:
                return body(*(bound[name] for name in names))
            result, launch = body(*(bound[name] for name in names))
            launch(bound.get("generator"))
            return result

        def prepare(*args, **kwargs) -> Callable:
            bound = checked(args, kwargs)
            if planned:
                result, launch = body(*(bound[name] for name in names))

                def run_planned(generator=None):
                    launch(generator)
                    return result

                return run_planned
            values = [bound[name] for name in names]
            at = names.index("generator") if "generator" in names else None

            def run(generator=None):
                if at is not None:
                    values[at] = generator
                return body(*values)

            return run

        op.__signature__ = signature
        op.prepare = prepare
        return op

    return decorate
