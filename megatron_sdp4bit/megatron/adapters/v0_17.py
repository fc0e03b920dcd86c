"""megatron-core 0.17: what changed since 0.16 at the layer's seams.

- ``start_grad_sync`` first copies the fp32 ``main_grad`` of params that keep an
  extra one (local accumulation in higher precision) into the communication
  buffer; ``finish_grad_sync`` copies the reduced values back (unchanged by us).
- ``start_param_sync`` gained a layer-wise optimizer branch (no distributed
  optimizer; ``bucket.param_data`` may be None). The layer refuses to quantize
  without the distributed optimizer, so that branch always runs megatron's own.
- Streams: ``current_stream`` instead of ``default_stream`` (the CPU backend
  provides both).
"""
from __future__ import annotations

from megatron_sdp4bit.megatron.adapters.v0_16 import Adapter as Adapter016


class Adapter(Adapter016):
    minor = "0.17"
    tested_versions = ("0.17.1",)

    def param_buffers(self, bucket_group):
        return [getattr(bucket, "param_data", None) for bucket in bucket_group.buckets]

    def before_grad_reduce(self, bucket_group) -> None:
        assert bucket_group.grad_reduce_handle is None, (
            "Should not have multiple communication calls outstanding at once")
        self._copy_extra_main_grads_in(bucket_group)
        self._check_and_scale_grads(bucket_group)

    def _copy_extra_main_grads_in(self, bucket_group) -> None:
        for bucket in bucket_group.buckets:
            for param in getattr(bucket, "params_with_extra_main_grads", ()):
                copy = getattr(param, "main_grad_copy_in_grad_buffer", None)
                if copy is not None:
                    copy.copy_(param.main_grad)
