"""CPU backend for megatron-core 0.16-0.19: GPTModel + DDP + the distributed optimizer on gloo.

``enable_cpu_backend()`` is an explicit, idempotent opt-in; ``disable_cpu_backend()``
puts back every original it replaced. The state (on or off, what was changed) is one
``CoreBackend`` object per process, ``BACKEND``. While enabled, megatron's own code path --
``GPTModel`` (local layer spec), ``DistributedDataParallel`` with its param/grad
buffers and bucket groups, ``get_megatron_optimizer`` (distributed or not), the
``forward_backward`` schedules, activation recomputation -- runs unchanged on CPU
tensors over a gloo process group. Nothing of megatron is reimplemented: only the
places that name CUDA are redirected. Which ones, per release, is the adapter's
``cpu_backend_sites()`` (a ``CoreSites``, ``megatron/adapters/cpu_sites.py``); every one
is listed below with the reason, paths relative to ``megatron/core``. "Hit" means
the tests in ``tests/cpu_backend/test_cpu_backend.py`` go through it (traced).

1. CUDA RNG tracker (``tensor_parallel/random.py``): megatron's own tracker runs; the
   "CUDA generator" it reads and writes becomes the CPU default generator, which is
   what CPU dropout and CPU init draw from.

   * ``CudaRNGStatesTracker.add`` calls ``torch.cuda.get_rng_state`` and
     ``torch.cuda.manual_seed`` itself: while it runs, those are the CPU generator's
     (``rng.CPU_GENERATOR_AS_CUDA``), so it stores a named CPU generator state. Hit by
     ``model_parallel_cuda_manual_seed``.
   * ``CudaRNGStatesTracker.fork`` is megatron's, unchanged (it goes through the two
     functions below); its "CPU RNG state changed within GPU RNG context" warning,
     which on CPU fires on every fork that draws since both generators are one, is
     dropped by a filter on its module's logger. Hit by weight init
     (``tensor_parallel/layers.py``) and attention dropout
     (``transformer/dot_product_attention.py``).
   * ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` ->
     ``torch.get_rng_state`` / ``torch.set_rng_state``. Hit by activation
     recomputation (``_get_all_rng_states`` / ``_set_all_rng_states`` in
     ``CheckpointFunction``), which must replay the forward's dropout masks.
   * ``model_parallel_cuda_manual_seed``: its ``torch.cuda.manual_seed(seed)``
     (the default "data-parallel" state) is a silent no-op on CPU torch; the
     wrapper also seeds the CPU generator with ``seed``, so un-forked dropout is seeded
     as on GPU. Rebound in ``random`` and in ``tensor_parallel`` (its re-export).

2. ``device='cuda'`` literals and ``param.type() == 'torch.cuda.*Tensor'`` checks,
   inside the megatron functions that contain them. Each function is wrapped so that,
   only while it runs, a ``TorchFunctionMode`` (``cuda_twins.CudaNamesOnCpu``) rewrites a CUDA
   ``device=`` keyword to CPU and makes ``Tensor.cuda()`` return the CPU tensor; where
   marked [type], ``Tensor.type()`` also reports a CPU tensor under its CUDA name
   (``torch.BFloat16Tensor`` -> ``torch.cuda.BFloat16Tensor``). Code outside these
   calls sees plain torch. Functions are rebound in every loaded ``megatron.core``
   module that holds them (``from x import f`` copies too); ``__init__``s on their class.

   * [type] ``optimizer/distrib_optimizer.py`` ``DistributedOptimizer.__init__``: the
     checks and (in ``_build_model_and_main_param_groups``) and
     that send bf16/fp16 params to fp32 main shards and fp32 params to in-place shards
     (anything else raises ``TypeError``), all hit; via ``super()`` the literals of
     ``MixedPrecisionOptimizer.__init__`` (``optimizer/optimizer.py``
     ``_dummy_overflow_buf`` for fp32 ``_scale_one``, both hit;
     ``found_inf`` with a grad scaler).
   * [type] ``optimizer/optimizer.py`` ``Float16OptimizerWithFloat16Params.__init__``
     (checks; same parent literals): bf16 without the distributed
     optimizer, hit. ``FP32Optimizer.__init__`` (literal): fp32 without it, hit.
   * ``optimizer/grad_scaler.py`` ``MegatronGradScaler.__init__`` and
     ``DynamicGradScaler.__init__`` (literals): a loss scale, which also turns on
     megatron's Inf/NaN step skipping (the driver sets a constant 1.0).
   * ``optimizer/clip_grads.py`` ``get_grad_norm_fp32`` (hit; other
     norms / no grads; also ``utils.py`` ``local_multi_tensor_l2_norm``, which
     it calls, hit) and ``count_zeros_fp32`` (with ``log_num_zeros_in_grad``);
     [type] ``clip_grad_by_total_norm_fp32`` (check and literal, hit).
     ``clip_grad`` defaults to 1.0, so every optimizer step goes through these. Bound
     also in ``optimizer/optimizer.py`` (and ``layer_wise_optimizer.py`` if loaded).
   * ``pipeline_parallel/schedules.py`` ``forward_backward_no_pipelining`` (literal
    , hit), ``forward_backward_pipelining_with_interleaving`` and
     ``forward_backward_pipelining_without_interleaving``: the
     ``total_num_tokens`` counter. ``get_forward_backward_func`` looks these up at call
     time, so it returns the wrapped ones. The mode stays active for the whole
     schedule, hooks included, but there it only redirects CUDA ``device=`` requests.
   * ``transformer/utils.py`` ``get_default_causal_mask`` (hit) and
     ``get_sliding_window_causal_mask``: the softmax's causal mask when
     ``attention_mask`` is None (``fusions/fused_softmax.py``).
   * ``models/common/language_module/language_module.py``
     ``LanguageModule.setup_embeddings_and_output_layer`` (a method, rebound on its
     class): with pipeline stages and tied embeddings, ``weight.data.cuda()`` before
     the first and last stages all-reduce their copies of the word embeddings
     (hit by ``tests/training/test_parallel_layouts.py``).

3. ``torch.cuda`` functions, replaced process-wide while enabled by CPU twins. This is
   the one global change and it cannot be narrower: megatron uses
   ``torch.cuda.current_device()`` as "the device" in 175 places across 57 modules,
   always through the ``torch.cuda`` module attribute, so no per-module swap reaches
   them. On CPU-only torch each of these raises "Torch not compiled with CUDA enabled",
   so the twins only turn crashes into CPU placement (on a CUDA build they redirect
   too: that is what opting in means).

   * ``current_device`` -> ``torch.cpu.current_device`` (returns ``'cpu'``, valid as
     ``device=``, in ``.to()`` and ``.cuda()``). Hit by the param/grad buffers
     (``distributed/param_and_grad_buffer.py``), every weight and bias
     allocation (``tensor_parallel/layers.py``)
     and the attention's scratch buffer (``utils.py``, from
     ``transformer/dot_product_attention.py``). Also covered, not on the tested
     path: ``gpt_model.py``, ``transformer/attention.py``,
     ``dot_product_attention.py``, ``transformer/module.py``,
     ``tensor_parallel/mappings.py`` (sequence/tensor parallel buffers).
   * ``synchronize`` -> no-op (``parallel_state.py`` ``update_pg_timeout``; DDP
     ``offload_grad_buffers`` / ``restore_grad_buffers``; the pipeline's
     ``pipeline_parallel/p2p_communication.py`` after batched sends): CPU ops and
     waited gloo handles are complete. The pipeline's receive buffers are allocated on
     ``current_device()`` (hit with pipeline parallelism); its sends and receives are
     gloo's ``isend``/``irecv``, batched or not.
   * ``Stream``, ``Event``, ``stream``, ``current_stream``, ``default_stream`` -> CPU
     stand-ins accepting the CUDA signatures: DDP's ``communication_stream``
     (``distributed/distributed_data_parallel.py``) and its use in
     ``param_and_grad_buffer.py``, all only with
     ``num_distributed_optimizer_instances > 1`` (not tested: that path needs
     ``einops``, which is not installed). CPU work runs in program order, so stream
     waits are no-ops.

Collectives: nothing to patch. With torch 2.13, gloo implements everything
``_ParamAndGradBucketGroup`` calls: ``reduce_scatter_tensor`` (SUM and AVG, async,
fp32 and bf16), ``all_gather_into_tensor`` (async), and ``_coalescing_manager``'s
fast-path coalescing of both (``reduce_scatter_single_coalesced`` /
``all_gather_single_coalesced``), whose manager object is the async handle megatron
stores as ``grad_reduce_handle`` / ``param_gather_handle``. ``megatron_sdp4bit.diagnostics.gloo_collectives``
runs exactly these calls on a live group and raises if a torch lacks one, instead of
letting training hang or diverge; the test harness calls it for every world.

Not covered (these still fail as before): ``enable_autocast`` (``torch.autocast("cuda")``
in ``schedules.py``), CUDA graphs, FP8/MXFP8 params, ``nccl_ub``, Transformer
Engine specs, the ``rerun_state_machine``'s RNG save/restore, megatron FSDP, optimizer
CPU offload.
"""
from __future__ import annotations

import logging
from typing import Iterator

import torch

from megatron_sdp4bit.cpu_backend import rng
from megatron_sdp4bit.cpu_backend.cuda_twins import TORCH_CUDA_TWINS, CudaNamesOnCpu, torch_cuda_as
from megatron_sdp4bit.cpu_backend.redirects import Redirects
from megatron_sdp4bit.megatron.adapters import current_adapter, supported_minors
from megatron_sdp4bit.megatron.adapters.cpu_sites import CoreSites, RngSites

__all__ = ["BACKEND", "CoreBackend", "enable_cpu_backend", "disable_cpu_backend",
           "is_cpu_backend_enabled", "cpu_backend"]


class CoreBackend(Redirects):
    """The redirects above (the numbers are the sections of this module's docstring)."""

    def __init__(self) -> None:
        super().__init__("CPU backend", f"this backend supports megatron-core {', '.join(supported_minors())}")

    def _apply(self) -> None:
        sites = current_adapter().cpu_backend_sites()  # imports what it names: every binding is seen
        for name, twin in TORCH_CUDA_TWINS.items():  # 3.
            self.patches.set(torch.cuda, name, twin)
        self._apply_rng(sites.rng)  # 1.
        self._apply_device_names(sites)  # 2.

    def _apply_rng(self, sites: RngSites) -> None:
        self.patches.set(sites.module, sites.get_state, rng.cpu_get_rng_state)
        self.patches.set(sites.module, sites.set_state, rng.cpu_set_rng_state)
        self.patches.set(sites.tracker, "add", self.while_enabled(
            vars(sites.tracker)["add"], lambda: torch_cuda_as(rng.CPU_GENERATOR_AS_CUDA)))
        logger = logging.getLogger(sites.fork_logger)
        self.patches.set(logger, "filters", [*logger.filters, rng.DropMessage(sites.fork_warning)])
        self.patches.set_everywhere(sites.seed_function,
                                    rng.seeding_the_cpu_generator_too(sites.seed_function, self),
                                    "megatron.core")

    def _apply_device_names(self, sites: CoreSites) -> None:
        for cls in sites.type_named_inits:
            self.patches.set(cls, "__init__", self.on_cpu(vars(cls)["__init__"], type_names=True))
        for cls in sites.inits:
            self.patches.set(cls, "__init__", self.on_cpu(vars(cls)["__init__"]))
        for function in sites.type_named_functions:
            self.patches.set_everywhere(function, self.on_cpu(function, type_names=True), "megatron.core")
        for function in sites.functions:
            self.patches.set_everywhere(function, self.on_cpu(function), "megatron.core")
        for owner, name in sites.methods:
            self.patches.set(owner, name, self._on_cpu_method(vars(owner)[name]))

    def on_cpu(self, original, type_names: bool = False):
        """``original`` under the device mode (``CudaNamesOnCpu``) while the backend is on."""
        return self.while_enabled(original, lambda: CudaNamesOnCpu(type_names))

    def _on_cpu_method(self, descriptor):
        """``on_cpu`` for a class attribute that may be a staticmethod or classmethod."""
        for kind in (staticmethod, classmethod):
            if isinstance(descriptor, kind):
                return kind(self.on_cpu(descriptor.__func__))
        return self.on_cpu(descriptor)


BACKEND = CoreBackend()
"""The process's CPU backend for megatron-core (what it redirects exists once per process)."""


def enable_cpu_backend() -> None:
    """Make megatron-core's GPT + DDP + distributed-optimizer path run on CPU (idempotent).

    Call it before building the model and optimizer (it is safe to call before or after
    ``torch.distributed.init_process_group('gloo', ...)``). Undo with
    ``disable_cpu_backend()``. A megatron-core release without an adapter is refused
    (``adapters.current_adapter``), since the sites it redirects may have moved.
    """
    BACKEND.enable()


def disable_cpu_backend() -> None:
    """Restore every original that ``enable_cpu_backend`` replaced (idempotent)."""
    BACKEND.disable()


def is_cpu_backend_enabled() -> bool:
    """Whether ``enable_cpu_backend()`` is in effect."""
    return BACKEND.enabled


def cpu_backend() -> "Iterator[None]":
    """Context manager: the CPU backend inside, the previous state after."""
    return BACKEND.enabled_inside()
