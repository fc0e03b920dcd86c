"""Triton kernels behind ``megatron_sdp4bit.quant.triton_ops`` (CUDA tensors).

- ``tile_math``: @triton.jit helpers shared by the kernels (fp32 loads/stores
  with exact bf16 rounding, the Hadamard butterfly, code unpacking).
- ``code_runs``: dequantize and chunk-sum of a contiguous run of elements
  (16-byte code loads, one scale load per 16 elements).
- ``noise``: stochastic rounding's noise (Philox-2x32-10, 8 bits per element, 8 a call).
- ``rounding``: codes from fp32 and back with magic-number adds (no conversions).
- ``strips``: the fast paths' 32 consecutive elements per thread (loads, stores, packing).
- ``quantize_kernel``: one kernel for every op that produces a QuantizedTensor.
- ``dequantize_kernel``: one kernel for every op that consumes one.
- ``launch_plan``: tile sizes, grids and the host-side views the kernels read.
- ``launch_record``, ``variants``, ``compile_check``: the variants real calls compile,
  recorded and compiled without a GPU.

Whether the kernels are compiled for the GPU or run by Triton's CPU interpreter
is fixed when these modules are imported (``TRITON_INTERPRET=1`` at that moment
means the interpreter); ``tile_math.INTERPRETED`` records which.
"""
