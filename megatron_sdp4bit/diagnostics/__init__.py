"""Checks a user runs on their own machine, as installed (no test suite needed).

- ``device_collectives``: the quantized collectives on this machine's devices
  against the CPU reference, under torchrun (``scripts/gpu_check.sh`` runs it with 4
  gloo ranks on one GPU, and with one NCCL rank per GPU when it sees 2 or more:
  ``--backend nccl``, README's "First run on a cluster").
- ``world``: the process group of that check and of the collectives benchmark.
- ``kernel_identity``: the kernels' gradient and weight paths at scale against the CPU
  reference (the GPU check's ``large`` step, ``tests/gpu``).
- ``overlap_profile``: how much of the quantized collectives' kernel time runs beside
  the backward and forward passes (the GPU check's ``overlap`` step).
"""
