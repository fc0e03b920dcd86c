"""What a kernel launch compiles to, worked out on any machine without launching it.

Triton compiles one variant of a kernel per combination of its constexprs, its
argument types and the specialisation of its arguments (an integer equal to 1
or divisible by 16, a pointer aligned to 16 bytes), and caches the variant
under a key made of them. Inside ``recording(arch)``, the kernels of this
package do not launch: each call records a ``Launch`` holding what
``JITFunction.run`` computes for an NVIDIA GPU of that architecture (with
Triton's own binder): the signature, constexprs, attributes, options and that
cache key. So an op of ``triton_ops`` called on CPU tensors inside the block
reports exactly the variant the same call on CUDA tensors of the same shapes
compiles, and ``Launch.compile()`` compiles it (Triton's LLVM and ptxas run on
the CPU).

Users: ``compile_check`` and ``scripts/kernel_ptx_stats.py`` (the variants the
real calls compile, ``variants.py``), and the warm-up test (``warmup.py``
must leave nothing for a real call to compile: the same keys).

This reads Triton's JIT internals (``create_function_from_signature``,
``JITFunction._pack_args``, ``compute_cache_key``, Triton 3.x) and needs the
compiled kernels (no TRITON_INTERPRET).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Iterator, List, Optional

_ACTIVE: Optional[list] = None  # the launches of the recording in progress


def active() -> bool:
    """True inside ``recording()``: ops may then take CPU tensors (nothing runs)."""
    return _ACTIVE is not None


@dataclasses.dataclass
class Launch:
    """One recorded launch: the kernel variant Triton would compile, and its cache key."""

    kernel: object
    grid: tuple
    signature: dict
    constexprs: dict
    attrs: dict
    options: object
    target: object
    key: str
    record_s: float = 0.0
    """CPU time this thread spent recording the launch (binding and keying, as a cache
    miss of ``JITFunction.run`` does): what a measurement of the caller's own host time
    subtracts."""

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def constexpr(self, name: str):
        """The value of constexpr ``name`` in this launch."""
        index = self.kernel.arg_names.index(name)
        return self.constexprs[(index,)]

    def compile(self):
        from triton.compiler import ASTSource, compile
        source = ASTSource(self.kernel, self.signature, self.constexprs, self.attrs)
        return compile(source, target=self.target, options=self.options.__dict__)


def _recorder(kernel, target, backend, launches: list):
    from triton import knobs
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, backend)

    def run(*args, grid, warmup, **kwargs):
        started = time.thread_time()
        # The options JITFunction.run adds before binding, so that the key matches
        # (Triton 3.9 added the float-sanitizer knob; 3.6, on the lent GPUs, has none).
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
            kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        bound_args, specialization, options = binder(*args, **kwargs)
        key = compute_cache_key({}, specialization, options)
        parsed, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound_args, specialization, options)
        if callable(grid):
            grid = grid(bound_args)
        launches.append(Launch(kernel, tuple(grid), signature, constexprs, attrs, parsed,
                               target, key, time.thread_time() - started))

    return run


@contextlib.contextmanager
def recording(arch: int = 90) -> Iterator[List[Launch]]:
    """Record (instead of running) every launch of this package's kernels; yields the list."""
    global _ACTIVE
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from megatron_sdp4bit.quant.triton_kernels.dequantize_kernel import dequantize_kernel
    from megatron_sdp4bit.quant.triton_kernels.quantize_kernel import quantize_kernel
    from megatron_sdp4bit.quant.triton_kernels.tile_math import INTERPRETED

    if INTERPRETED:
        raise RuntimeError("recording needs the compiled kernels: unset TRITON_INTERPRET")
    if _ACTIVE is not None:
        raise RuntimeError("a launch recording is already in progress")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    launches: List[Launch] = []
    kernels = (quantize_kernel, dequantize_kernel)
    for kernel in kernels:  # an instance attribute shadows JITFunction.run
        kernel.run = _recorder(kernel, target, backend, launches)
    _ACTIVE = launches
    try:
        yield launches
    finally:
        _ACTIVE = None
        for kernel in kernels:
            del kernel.run
