"""CPU mode for Megatron-LM's training loop (``megatron.training.pretrain``), on gloo.

``core.py`` makes megatron-core's model, DDP, distributed optimizer and schedules run
on CPU tensors. ``megatron.training`` (Megatron-LM's loop: argument validation,
``initialize_megatron``, ``pretrain``/``train``/``train_step``, logging, data
loaders) names CUDA in more places. ``enable_cpu_training()`` turns on ``core.py``'s
backend and redirects those, so that an unedited Megatron-LM style script
(``pretrain(...)`` with a model provider, a dataset provider and a forward step)
trains on CPU ranks over gloo. Switch it on explicitly: call it before the script
imports ``megatron.training``, or set ``SDP4BIT_CPU=1`` for the launcher
(``python -m megatron_sdp4bit.launch script.py ...`` calls it before it runs the
script). Only for releases whose adapter lists the sites
(``cpu_training_sites()``, a ``TrainingSites``: megatron-core 0.19, whose wheel ships
``megatron/training``). The state is one ``CpuTraining`` object per process, ``TRAINING``.

Every redirect, where and why (paths relative to ``megatron/``); each is the
narrowest that reached the site, and only the pretrain-wide device mode (7) spans
more than one function. All are hit by ``tests/megatron_lm/test_megatron_training_loop.py``
except where noted.

1. ``training/initialize.py`` ``initialize_megatron`` (rebound in every loaded
   ``megatron.training`` module): called with ``allow_no_cuda=True``, which skips its
   ``assert torch.cuda.is_available(), "Megatron requires CUDA."``, and with
   ``args.distributed_backend = "gloo"`` (the flag defaults to ``nccl``, which has no
   CPU tensors; it is read only by ``_initialize_distributed``).
2. ``training/initialize.py`` ``_initialize_distributed`` and ``_set_random_seed``:
   while each runs, ``torch.cuda.device_count()`` answers 1 and
   ``torch.cuda.set_device`` does nothing. Both gate their work on
   ``device_count() > 0``: without a device, ``initialize_model_parallel`` (TP/PP/DP
   groups) and ``model_parallel_cuda_manual_seed`` (the RNG tracker, made CPU by
   ``core.py``) would be skipped silently. ``torch.cuda`` is put back when they return.
3. ``training/initialize.py`` ``_warmup_jit_function`` -> nothing. It runs the fused
   bias-GeLU / bias-dropout-add kernels on ``device="cuda"`` tensors to compile them
   for the GPU; on CPU there is nothing to warm up (and the CPU run uses the unfused
   paths, ``--no-bias-gelu-fusion --no-bias-dropout-fusion``).
4. ``training/checkpointing.py`` ``get_rng_state`` (what ``save_checkpoint`` stores)
   and ``load_checkpoint`` (rebound in every ``megatron.training`` module): while each
   runs, ``torch.cuda.get_rng_state`` / ``set_rng_state`` are the CPU generator's.
   Both store or restore the "CUDA generator" beside the CPU one; on CPU-only torch
   they raise "Torch not compiled with CUDA enabled" at the first ``--save``. The
   state saved is then a second copy of the CPU generator's, restored after it.
5. ``core/rerun_state_machine.py`` ``RerunStateMachine._save_state`` /
   ``_restore_state``: while each runs, ``torch.cuda.get_rng_state`` /
   ``set_rng_state`` are the CPU generator's. The state machine saves the CUDA
   generator before every step (``should_run_forward_backward``); on CPU the "CUDA
   generator" is the CPU one (as in ``core.py``), already saved beside it, so this only
   turns a crash into a second copy. ``_restore_state`` runs only on a rerun (not hit).
6. ``training/utils/common_utils.py`` ``get_device_arch_version`` (rebound in every
   ``megatron.training`` module) -> 0, no CUDA architecture. ``validate_args`` asks it
   for tensor/context parallelism (and FSDP, GTP), through
   ``torch.cuda.get_device_properties``. 0 is "before Blackwell", so with TP > 1
   ``validate_args`` requires ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in the environment,
   as on a Hopper GPU (set it; it means nothing on CPU).
7. ``training/training.py`` ``pretrain`` (rebound in every ``megatron.training``
   module): runs under ``cuda_twins.CudaNamesOnCpu``, the backend's device mode, which turns a CUDA
   ``device=`` keyword into CPU and makes ``Tensor.cuda()`` return the tensor.
   ``pretrain`` itself all-reduces its start time from ``device='cuda'`` literals,
   and everything the loop calls names CUDA the same way: ``get_model``
   (``model_module.cuda(...)``), ``build_train_valid_test_data_loaders`` /
   ``_get_iterator`` (flags tensors), ``training_log`` / ``evaluate`` (loss
   accumulators), ``checkpoint_and_decide_exit`` (exit flags), the user's
   ``get_batch`` (``.cuda(non_blocking=True)``); 13 ``device='cuda'`` literals and
   two ``.cuda()`` calls in ``training.py`` alone. A literal cannot be patched and
   every one of them runs inside ``pretrain``, so the mode is on for its duration (as
   ``core.py`` does for the schedules). Code the loop calls that truly wants CUDA would
   be redirected too; on CPU there is none.

8. ``core/optimizer/distrib_optimizer.py`` ``_set_main_param_and_optimizer_states``
   (a ``--ckpt-format torch`` load, ``load_parameter_state_from_dp_zero``): it copies
   every state the optimizer holds from the file's tensors, but without Apex or
   Transformer Engine (always on CPU) the optimizer is torch's AdamW, whose per-parameter
   ``step`` the file does not hold (``load_state_dict`` already set it from the param
   groups): ``KeyError: 'step'``; and a ``torch_dist`` load hands it the ``step`` of the
   load's template (0, see 9), which would start AdamW's bias correction over. States the
   file lacks, and the ``step`` the param groups restored, are kept as they are.
9. ``core/optimizer/distrib_optimizer.py`` ``DistributedOptimizer.state_dict`` (the
   template of a ``--ckpt-format torch_dist`` load, built before any step): without
   Apex or Transformer Engine it asserts that every parameter's state holds one and the
   same ``step``, but megatron's ``init_state_fn`` makes ``exp_avg`` / ``exp_avg_sq``
   only (``AssertionError`` at ``assert len(steps) == 1``). States without a ``step``
   get torch AdamW's own starting value, 0 (what its first step would create; the load
   then sets the saved one).
10. ``core/dist_checkpointing/strategies/async_utils.py``
    ``PersistentAsyncCaller.async_loop``, the persistent checkpoint worker of
    ``--async-save --use-persistent-ckpt-worker`` (``torch_dist`` saves asynchronously only
    with it): megatron starts it in a spawned process, which has none of these redirects;
    it selected ``rank % torch.cuda.device_count()`` (a ZeroDivisionError) and died, and the
    rank waited for it at the first save, for good. ``checkpoint_worker.py`` runs it there
    with ``torch.cuda`` as one CPU device.
11. ``training/arguments.py`` ``validate_args`` (rebound in every ``megatron.training``
    module): before it runs, ``megatron_args.CPU_SETTINGS``: ``--transformer-impl local`` (0.19's default,
    Transformer Engine, is not installed: ``TypeError: 'NoneType' object is not callable``
    on every rank when the model is built), the fused kernels off (Apex and CUDA code:
    ``AssertionError: persist_layer_norm not supported by torch LayerNorm`` and the like)
    and ``--distributed-backend gloo``; rank 0 says in one line which it set.

Needs nothing more, because ``core.py`` already replaces them process-wide:
``torch.cuda.current_device`` (every allocation, the timers' tensors),
``synchronize`` (``core/timers.py`` with ``--timing-log-level``, barriers in
``train``), ``Stream`` / ``stream`` / ``current_stream`` (``get_model`` builds DDP
inside a side stream). ``torch.cuda.memory_allocated`` and friends
(``report_memory`` after the first iteration, ``training_log``) and
``empty_cache`` do not raise on CPU-only torch: the memory report reads 0 MB.

Not covered (each fails as it did): ``--profile`` (``torch.cuda.cudart()``), CUDA
graphs, Transformer Engine, FP8/FP4, Megatron-FSDP / torch FSDP2, optimizer CPU
offload, ``--inprocess-restart``, checkpoint formats other than ``torch`` and
``torch_dist`` (the two tested), ``--async-strategy nvrx`` (nvidia-resiliency-ext),
the MoE aux-loss scaler, pipeline parallelism (untested), models whose layer specs need
Transformer Engine (``pretrain_hybrid.py``'s Mamba stack).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Iterator, Mapping

import torch

from megatron_sdp4bit.cpu_backend.checkpoint_worker import redirect_worker
from megatron_sdp4bit.cpu_backend.core import BACKEND, CoreBackend
from megatron_sdp4bit.cpu_backend.cuda_twins import CudaNamesOnCpu, torch_cuda_as
from megatron_sdp4bit.cpu_backend.megatron_args import settle_args_for_cpu
from megatron_sdp4bit.cpu_backend.redirects import Redirects
from megatron_sdp4bit.megatron.adapters.cpu_sites import TrainingSites

__all__ = ["ENV_VAR", "TRAINING", "CpuTraining", "enable_cpu_training", "disable_cpu_training",
           "is_cpu_training_enabled", "cpu_training", "cpu_training_requested"]

ENV_VAR = "SDP4BIT_CPU"
"""``SDP4BIT_CPU=1``: the launcher calls ``enable_cpu_training()`` before the script runs."""


def cpu_training_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``SDP4BIT_CPU`` asks for the CPU mode (set, and not "0")."""
    return environ.get(ENV_VAR, "0") not in ("", "0")


logger = logging.getLogger(__name__)


def _one_device() -> int:
    return 1


def _select_no_device(device: Any) -> None:
    return None


_ONE_CPU_DEVICE = {"device_count": _one_device, "set_device": _select_no_device}
"""2. initialize: one "device", the CPU; selecting it does nothing."""


def _cpu_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


_CPU_RNG_AS_CUDA = {"get_rng_state": _cpu_get_rng_state, "set_rng_state": _cpu_set_rng_state}
"""4. checkpoints and 5. the rerun state machine: the "CUDA generator" is the CPU one."""


def _skip_jit_warmup(tp_size=None) -> None:
    """3. Stand-in for ``initialize._warmup_jit_function``: nothing to warm up on CPU."""


def _no_cuda_arch() -> int:
    """6. Stand-in for ``get_device_arch_version``: no CUDA architecture."""
    return 0


def _keep_states_not_in_file(original: Callable) -> Callable:
    """8. The optimizer's states of ``model_param`` that ``tensors`` (read from the file)
    lacks, and its ``step``, are passed as they are: the original copies them onto themselves."""

    def set_main_param_and_optimizer_states(optimizer, model_param, tensors):
        group_index, group_order = optimizer.model_param_group_index_map[model_param]
        main_param = optimizer.optimizer.param_groups[group_index]["params"][group_order]
        held = optimizer.optimizer.state.get(main_param, {})
        kept = {key: value for key, value in held.items() if key not in tensors or key == "step"}
        return original(optimizer, model_param, {**tensors, **kept})

    return set_main_param_and_optimizer_states


def _step_in_fresh_states(original: Callable) -> Callable:
    """9. The original, with a ``step`` of 0 in every parameter state that has none yet
    while it runs (taken out again: torch AdamW initializes a state that is empty or
    has no ``step`` itself; the result keeps the step in its param groups only)."""

    def state_dict(optimizer):
        inner = optimizer.optimizer
        added = [param for group in inner.param_groups for param in group["params"]
                 if "step" not in inner.state.get(param, {})]
        for param in added:
            inner.state[param]["step"] = torch.tensor(0.0)
        try:
            return original(optimizer)
        finally:
            for param in added:
                del inner.state[param]["step"]
                if not inner.state[param]:
                    del inner.state[param]

    return state_dict


class CpuTraining(Redirects):
    """The redirects above, on top of the core backend (enabled with them, and disabled
    with them if it was this object that enabled it)."""

    marker = "__wrapped_by_cpu_training__"

    def __init__(self, backend: CoreBackend) -> None:
        super().__init__("CPU training", "the adapter's cpu_training_sites() is stale")
        self.backend = backend
        self.started_backend = False
        """Whether ``enable`` turned the core backend on (then ``disable`` turns it off)."""
        self._sites: TrainingSites = None

    def enable(self) -> None:
        """Refused, changing nothing, where ``megatron.training`` is missing or the
        release's adapter has no ``cpu_training_sites()``."""
        if self.enabled:
            return
        try:
            import megatron.training  # noqa: F401
        except ImportError as error:
            raise RuntimeError(
                f"CPU training: megatron.training (Megatron-LM's training loop) is not importable "
                f"({error}); it ships in the megatron-core 0.19 wheel or a Megatron-LM checkout"
            ) from error
        from megatron_sdp4bit.megatron.adapters import current_adapter

        adapter = current_adapter()
        self._sites = adapter.cpu_training_sites()
        if self._sites is None:
            raise RuntimeError(
                f"CPU training: not available for megatron-core {adapter.minor} (the sites in "
                f"megatron.training are known for 0.19 only); the CPU backend for "
                f"megatron-core alone is (enable_cpu_backend)")
        started_backend = not self.backend.enabled
        self.backend.enable()
        try:
            super().enable()
        except BaseException:
            if started_backend:
                self.backend.disable()
            raise
        self.started_backend = started_backend

    def disable(self) -> None:
        super().disable()
        if self.started_backend:
            self.backend.disable()
        self.started_backend = False

    def _apply(self) -> None:
        sites = self._sites
        set_everywhere = self.patches.set_everywhere
        set_everywhere(sites.initialize_megatron, self._initialize_megatron_on_cpu(sites.initialize_megatron),
                       "megatron.training")
        for owner, name in sites.one_device:
            self.patches.set(owner, name, self._with_torch_cuda(vars(owner)[name], _ONE_CPU_DEVICE))
        self.patches.set(*sites.jit_warmup, _skip_jit_warmup)
        for function in sites.checkpoint_rng:
            set_everywhere(function, self._with_torch_cuda(function, _CPU_RNG_AS_CUDA), "megatron.training")
        for owner, name in sites.rng_save_restore:
            self.patches.set(owner, name, self._with_torch_cuda(vars(owner)[name], _CPU_RNG_AS_CUDA))
        set_everywhere(sites.device_arch, _no_cuda_arch, "megatron.training")
        set_everywhere(sites.pretrain, self.while_enabled(sites.pretrain, CudaNamesOnCpu), "megatron.training")
        for site, fix in ((sites.optimizer_state_setter, _keep_states_not_in_file),
                          (sites.optimizer_state_dict, _step_in_fresh_states)):
            if site is not None:
                owner, name = site
                self.patches.set(owner, name, self.marked(fix(vars(owner)[name]), vars(owner)[name]))
        if sites.validate_args is not None:
            set_everywhere(sites.validate_args, self._validate_args_on_cpu(sites.validate_args), "megatron.training")
        if sites.checkpoint_worker is not None:
            redirect_worker(sites.checkpoint_worker, self.patches)

    def _with_torch_cuda(self, original: Callable, twins: Dict[str, Any]) -> Callable:
        return self.while_enabled(original, lambda: torch_cuda_as(twins))

    def _validate_args_on_cpu(self, original: Callable) -> Callable:
        """11. ``CPU_SETTINGS`` before Megatron-LM validates the arguments; one line from rank 0."""

        def validate_args(args, *rest, **kwargs):
            if self.enabled:
                changed = settle_args_for_cpu(args)
                if changed and os.environ.get("RANK", "0") == "0":  # every rank sets the same
                    print(f"CPU mode ({ENV_VAR}=1): {' '.join(changed)} (Transformer Engine, Apex and the fused "
                          "kernels are GPU code)", flush=True)
            return original(args, *rest, **kwargs)

        return self.marked(validate_args, original)

    def _initialize_megatron_on_cpu(self, original: Callable) -> Callable:
        """1. ``allow_no_cuda=True`` and the gloo backend."""

        def initialize_megatron(*args, **kwargs):
            if self.enabled:
                from megatron.training import get_args

                if args:  # allow_no_cuda is the first parameter
                    args = (True,) + tuple(args[1:])
                else:
                    kwargs["allow_no_cuda"] = True
                megatron_args = get_args()
                if megatron_args.distributed_backend != "gloo":
                    logger.info("CPU training: --distributed-backend %s -> gloo",
                                megatron_args.distributed_backend)
                    megatron_args.distributed_backend = "gloo"
            return original(*args, **kwargs)

        return self.marked(initialize_megatron, original)


TRAINING = CpuTraining(BACKEND)
"""The process's CPU mode for ``megatron.training``."""


def enable_cpu_training() -> None:
    """Make ``megatron.training.pretrain`` run on CPU over gloo (idempotent).

    Enables the CPU backend for megatron-core too. Call it before the training script
    imports ``megatron.training`` names (``from megatron.training import pretrain``
    copies the function), or let the launcher do it (``SDP4BIT_CPU=1``). Refused,
    changing nothing, where ``megatron.training`` is missing or the release's adapter
    has no ``cpu_training_sites()``.
    """
    TRAINING.enable()


def disable_cpu_training() -> None:
    """Put back everything ``enable_cpu_training`` replaced (idempotent); also disables
    the CPU backend if it was ``enable_cpu_training`` that enabled it."""
    TRAINING.disable()


def is_cpu_training_enabled() -> bool:
    """Whether ``enable_cpu_training()`` is in effect."""
    return TRAINING.enabled


def cpu_training() -> "Iterator[None]":
    """Context manager: CPU training inside, the previous state after."""
    return TRAINING.enabled_inside()
