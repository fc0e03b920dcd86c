"""Checks a user runs on their own machine, as installed (no test suite needed).

- ``device_collectives``: the quantized collectives on this machine's devices
  against the CPU reference, under torchrun (``scripts/gpu_check.sh`` runs it with 4
  gloo ranks on one GPU).
"""
