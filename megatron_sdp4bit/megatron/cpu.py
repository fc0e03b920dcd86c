"""CPU backend for megatron-core 0.16-0.19: GPTModel + DDP + the distributed optimizer on gloo.

``enable_cpu_backend()`` is an explicit, idempotent opt-in; ``disable_cpu_backend()``
puts back every original it replaced. While enabled, megatron's own code path --
``GPTModel`` (local layer spec), ``DistributedDataParallel`` with its param/grad
buffers and bucket groups, ``get_megatron_optimizer`` (distributed or not), the
``forward_backward`` schedules, activation recomputation -- runs unchanged on CPU
tensors over a gloo process group. Nothing of megatron is reimplemented: only the
places that name CUDA are redirected. Which ones, per release, is the adapter's
``cpu_backend_sites()`` (``adapters/``); every one is listed below with the reason,
paths relative to ``megatron/core``. "Hit" means
the tests in ``tests/megatron/test_cpu_backend.py`` go through it (traced).

1. CUDA RNG tracker (``tensor_parallel/random.py``): module and class attributes
   swapped for CPU twins. The tracker's "CUDA generator" becomes the CPU default
   generator, which is what CPU dropout and CPU init draw from.

   * ``CudaRNGStatesTracker.add`` (calls ``torch.cuda.get_rng_state`` and
     ``torch.cuda.manual_seed``) -> a named CPU generator state. Hit by
     ``model_parallel_cuda_manual_seed``.
   * ``CudaRNGStatesTracker.fork`` -> the same bookkeeping on the CPU
     generator, minus the original's "CPU RNG state changed within GPU RNG context"
     warning, which on CPU would fire on every dropout since both generators
     are one. Hit by weight init (``tensor_parallel/layers.py``) and attention
     dropout (``transformer/dot_product_attention.py``).
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
   only while it runs, a ``TorchFunctionMode`` (``_CudaNamesOnCpu``) rewrites a CUDA
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
stores as ``grad_reduce_handle`` / ``param_gather_handle``. ``check_gloo_collectives``
runs exactly these calls on a live group and raises if a torch lacks one, instead of
letting training hang or diverge; the test harness calls it for every world.

Not covered (these still fail as before): ``enable_autocast`` (``torch.autocast("cuda")``
in ``schedules.py``), CUDA graphs, FP8/MXFP8 params, ``nccl_ub``, Transformer
Engine specs, the ``rerun_state_machine``'s RNG save/restore, megatron FSDP, optimizer
CPU offload.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_sdp4bit.megatron.adapters import current_adapter, supported_minors
from megatron_sdp4bit.patching import Patches

__all__ = [
    "enable_cpu_backend",
    "disable_cpu_backend",
    "is_cpu_backend_enabled",
    "cpu_backend",
    "check_gloo_collectives",
]

_enabled = False
_patches = Patches("CPU backend", f"this backend supports megatron-core {', '.join(supported_minors())}")


# --------------------------------------------------------------------------- torch.cuda


class _CpuStream(torch.cpu.Stream):
    """``torch.cuda.Stream`` stand-in: accepts the CUDA signature; CPU work is in order."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        super().__init__()

    def synchronize(self) -> None:
        """Nothing to wait for: CPU kernels finish before the call returns."""

    def query(self) -> bool:
        """Always complete."""
        return True


class _CpuEvent(torch.cpu.Event):
    """``torch.cuda.Event`` stand-in: accepts the CUDA signature; always complete."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **kwargs) -> None:
        super().__init__()


def _cpu_default_stream(device=None) -> torch.cpu.Stream:
    return torch.cpu.current_stream()


_TORCH_CUDA_TWINS = {
    "current_device": torch.cpu.current_device,
    "synchronize": torch.cpu.synchronize,
    "Stream": _CpuStream,
    "Event": _CpuEvent,
    "stream": torch.cpu.stream,
    "current_stream": torch.cpu.current_stream,
    "default_stream": _cpu_default_stream,
}


# ------------------------------------------------- device literals and type-name checks


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class _CudaNamesOnCpu(TorchFunctionMode):
    """Lets megatron code that names CUDA run on CPU tensors, while it is active.

    * a CUDA ``device=`` keyword (``'cuda'``, ``'cuda:0'``, ``torch.device('cuda')``)
      becomes ``'cpu'``;
    * ``Tensor.cuda(...)`` returns the tensor itself (it already is on the CPU);
    * with ``type_names=True`` only: ``Tensor.type()`` without arguments reports a CPU
      tensor under its CUDA name (``torch.cuda.FloatTensor``), because megatron decides
      how to shard a param by comparing that string.
    """

    def __init__(self, type_names: bool):
        super().__init__()
        self.type_names = type_names

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.type_names and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(args[0])
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _cuda_type_name(tensor: torch.Tensor) -> str:
    name = torch.Tensor.type(tensor)
    if tensor.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
        return "torch.cuda." + name[len("torch."):]
    return name


def _on_cpu(original: Callable, type_names: bool = False) -> Callable:
    """Wrap ``original`` so that it runs under ``_CudaNamesOnCpu`` while the backend is on."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not _enabled:  # a copy bound after enable and kept after disable
            return original(*args, **kwargs)
        with _CudaNamesOnCpu(type_names):
            return original(*args, **kwargs)

    wrapper.__wrapped_by_cpu_backend__ = original
    return wrapper


# ------------------------------------------------------------------------- RNG tracker


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False,
                       graph_safe: bool = False) -> torch.Tensor:
    """CPU twin of ``random._get_cuda_rng_state``: the CPU default generator's state."""
    if graph_safe:
        raise ValueError("CPU backend: CUDA-graph-safe RNG states do not exist on CPU; "
                         "build the RNG tracker with use_cudagraphable_rng=False")
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1,
                       graph_safe: bool = False) -> None:
    """CPU twin of ``random._set_cuda_rng_state``."""
    if graph_safe:
        raise ValueError("CPU backend: CUDA-graph-safe RNG states do not exist on CPU; "
                         "build the RNG tracker with use_cudagraphable_rng=False")
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """CPU twin of ``CudaRNGStatesTracker.add``: a named CPU generator state from ``seed``."""
    if getattr(self, "use_cudagraphable_rng", False):
        raise ValueError("CPU backend: CUDA-graph-safe RNG states do not exist on CPU; "
                         "build the RNG tracker with use_cudagraphable_rng=False")
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    outer_state = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(outer_state)


def _make_cpu_tracker_fork(default_name: str) -> Callable:
    @contextlib.contextmanager
    def fork(self, name: str = default_name) -> Iterator[None]:
        """CPU twin of ``CudaRNGStatesTracker.fork``: draw from state ``name``, then restore."""
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer_state = torch.get_rng_state()
        outer_name = self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(f"current state name {self._current_state_name} is not the "
                                f"same as the desired state name {name}.")
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name

    return fork


def _seed_cpu_default_generator_too(original: Callable) -> Callable:
    @functools.wraps(original)
    def model_parallel_cuda_manual_seed(seed: int, *args, **kwargs):
        if _enabled:
            torch.manual_seed(seed)  # what torch.cuda.manual_seed(seed) does on a GPU
        return original(seed, *args, **kwargs)

    model_parallel_cuda_manual_seed.__wrapped_by_cpu_backend__ = original
    return model_parallel_cuda_manual_seed


def _apply_patches(adapter) -> None:
    sites = adapter.cpu_backend_sites()  # imports what it names, so every binding is seen
    random = sites["rng"]

    # 3. torch.cuda functions (see module docstring).
    for name, twin in _TORCH_CUDA_TWINS.items():
        _patches.set(torch.cuda, name, twin)

    # 1. RNG tracker.
    get_state, set_state = sites["rng_state_functions"]
    _patches.set(random, get_state, _cpu_get_rng_state)
    _patches.set(random, set_state, _cpu_set_rng_state)
    _patches.set(sites["rng_tracker"], "add", _cpu_tracker_add)
    _patches.set(sites["rng_tracker"], "fork", _make_cpu_tracker_fork(sites["rng_tracker_name"]))
    seed_fn = sites["rng_seed_function"]
    _patches.set_everywhere(seed_fn, _seed_cpu_default_generator_too(seed_fn), "megatron.core")

    # 2. Functions that name CUDA in device literals or type-name checks.
    for cls in sites["type_named_inits"]:
        _patches.set(cls, "__init__", _on_cpu(vars(cls)["__init__"], type_names=True))
    for cls in sites["inits"]:
        _patches.set(cls, "__init__", _on_cpu(vars(cls)["__init__"]))
    for fn in sites["type_named_functions"]:
        _patches.set_everywhere(fn, _on_cpu(fn, type_names=True), "megatron.core")
    for fn in sites["functions"]:
        _patches.set_everywhere(fn, _on_cpu(fn), "megatron.core")
    for owner, name in sites.get("methods", ()):
        _patches.set(owner, name, _on_cpu_method(vars(owner)[name], type_names=False))


def _on_cpu_method(descriptor, type_names: bool):
    """``_on_cpu`` for a class attribute that may be a staticmethod or classmethod."""
    for kind in (staticmethod, classmethod):
        if isinstance(descriptor, kind):
            return kind(_on_cpu(descriptor.__func__, type_names))
    return _on_cpu(descriptor, type_names)


# ------------------------------------------------------------------------- public API


def enable_cpu_backend() -> None:
    """Make megatron-core's GPT + DDP + distributed-optimizer path run on CPU (idempotent).

    Call it before building the model and optimizer (it is safe to call before or after
    ``torch.distributed.init_process_group('gloo', ...)``). Undo with
    ``disable_cpu_backend()``. A megatron-core release without an adapter is refused
    (``adapters.current_adapter``), since the sites it redirects may have moved.
    """
    global _enabled
    if _enabled:
        return
    adapter = current_adapter()  # refuses a megatron-core release it has no sites for
    try:
        _apply_patches(adapter)
    except BaseException:
        _patches.restore()
        raise
    _enabled = True


def disable_cpu_backend() -> None:
    """Restore every original that ``enable_cpu_backend`` replaced (idempotent)."""
    global _enabled
    _patches.restore()
    _enabled = False


def is_cpu_backend_enabled() -> bool:
    """Whether ``enable_cpu_backend()`` is in effect."""
    return _enabled


@contextlib.contextmanager
def cpu_backend() -> Iterator[None]:
    """Context manager: the CPU backend inside, the previous state after."""
    was_enabled = _enabled
    enable_cpu_backend()
    try:
        yield
    finally:
        if not was_enabled:
            disable_cpu_backend()


def check_gloo_collectives(group: "torch.distributed.ProcessGroup | None" = None) -> None:
    """Verify on ``group`` the gloo collectives megatron's bucket groups rely on.

    Runs, for fp32 and bf16, the calls ``_ParamAndGradBucketGroup`` makes: coalesced
    async ``reduce_scatter_tensor`` (SUM and AVG) and coalesced async
    ``all_gather_into_tensor``, and compares with the exact answer. Raises
    ``RuntimeError`` naming the missing or wrong collective.
    """
    import torch.distributed as dist
    from torch.distributed import _coalescing_manager

    group = group if group is not None else dist.group.WORLD
    rank, size = group.rank(), group.size()
    for dtype in (torch.float32, torch.bfloat16):
        for op, scale in ((dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.AVG, 1.0 / size)):
            inputs = [torch.arange(2 * size, dtype=dtype) * (k + 1) + rank for k in range(2)]
            outputs = [torch.empty(2, dtype=dtype) for _ in range(2)]
            try:
                with _coalescing_manager(group, async_ops=True) as cm:
                    for out, inp in zip(outputs, inputs):
                        dist.reduce_scatter_tensor(out, inp, op=op, group=group, async_op=True)
                cm.wait()
            except (RuntimeError, NotImplementedError, ValueError) as err:
                raise RuntimeError(
                    f"CPU backend: this torch's gloo cannot run megatron's coalesced async "
                    f"reduce_scatter_tensor ({op}, {dtype}): {err}") from err
            ranks_sum = size * (size - 1) / 2
            for k, out in enumerate(outputs):
                idx = torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float64)
                want = (idx * (k + 1) * size + ranks_sum) * scale
                if not torch.allclose(out.double(), want, rtol=1e-2):
                    raise RuntimeError(
                        f"CPU backend: gloo reduce_scatter_tensor ({op}, {dtype}) returned "
                        f"{out.tolist()} on rank {rank}, expected {want.tolist()}")
        shards = [torch.full((2,), float(rank + k), dtype=dtype) for k in range(2)]
        gathered = [torch.empty(2 * size, dtype=dtype) for _ in range(2)]
        try:
            with _coalescing_manager(group, async_ops=True) as cm:
                for out, inp in zip(gathered, shards):
                    dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
            cm.wait()
        except (RuntimeError, NotImplementedError, ValueError) as err:
            raise RuntimeError(
                f"CPU backend: this torch's gloo cannot run megatron's coalesced async "
                f"all_gather_into_tensor ({dtype}): {err}") from err
        for k, out in enumerate(gathered):
            want = (torch.arange(size).repeat_interleave(2) + k).to(dtype)
            if not torch.equal(out, want):
                raise RuntimeError(
                    f"CPU backend: gloo all_gather_into_tensor ({dtype}) returned "
                    f"{out.tolist()} on rank {rank}, expected {want.tolist()}")
