"""How a run was laid out, as a checkpoint records it, and whether another run can load it.

``current_layout`` is what a checkpoint's manifest records; ``compare_layouts``
decides, from the saved and the current layout alone, whether the checkpoint is
loaded as it is, resharded to another data-parallel size, loaded with a warning,
or refused in one line that says which flag to change. What decides the training
samples (seed, sequence length, data, split, tokenizer, global batch size) is
recorded and compared by ``training_data``, the flags that shape the model by
``model_record``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from megatron.core import parallel_state

from megatron_sdp4bit.config import PRESETS
from megatron_sdp4bit.megatron import adapters, patch
from megatron_sdp4bit.training.checkpoint.common import CheckpointError, adapter, pipeline_stage, rank_and_world
from megatron_sdp4bit.training.checkpoint.model_record import compare_models, model_record
from megatron_sdp4bit.training.checkpoint.training_data import compare_data


def own_buckets(optimizer) -> list:
    """This rank's optimizer buckets (dtypes, element counts), one list per sub-optimizer."""
    return [adapter().bucket_layout(opt) for opt in adapter().sub_optimizers(optimizer)]


def _parallel_sizes() -> dict:
    _, world = rank_and_world()
    if not parallel_state.model_parallel_is_initialized():
        return {"data_parallel_size": world, "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1}
    return {"data_parallel_size": parallel_state.get_data_parallel_world_size(),
            "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size()}


def current_layout(model, optimizer, stage_buckets: Optional[dict] = None,
                   data: Optional[dict] = None) -> dict:
    """What a checkpoint of this run records about how it was run (JSON-ready).

    ``buckets`` maps each pipeline stage to its optimizer buckets: all stages'
    (``stage_buckets``, gathered by the saving ranks), else only this rank's.
    ``data``: what decides the training samples it reads, when it has them
    (``training_data.TrainingData.record``).
    """
    _, world = rank_and_world()
    config = patch.current_config()
    chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]  # virtual stages
    ddp_config = getattr(chunks[0], "ddp_config", None) if chunks else None
    buckets = own_buckets(optimizer)
    return {
        "world_size": world, **_parallel_sizes(),
        "megatron_core": adapters.megatron_version(),
        "sdp4bit": config.to_dict() if config is not None else None,
        "model": model_record(model),
        "optimizer": "plain" if all(b is None for b in buckets) else "distributed",
        "params_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "buckets": stage_buckets if stage_buckets is not None else {pipeline_stage(): buckets},
        "bucket_size": getattr(ddp_config, "bucket_size", None),
        "data": data,
    }


def preset_name(config: Optional[dict]) -> str:
    """The preset a recorded SDP4Bit config is, in words."""
    if config is None:
        return "no SDP4Bit layer"
    # where and how it ran, not which method
    ignored = ("ranks_per_node", "seed", "check_interval", "runner")
    for name, candidate in PRESETS.items():
        known = candidate.to_dict()
        if all(config.get(k) == v for k, v in known.items() if k not in ignored):
            return f"preset {name}"
    return "a custom SDP4Bit config"


def release(version: str) -> str:
    """``0.19.2`` of ``0.19.2+3b25f53``: megatron-core 0.19 appends the git commit of the
    directory it is imported from, which says nothing about the checkpoint."""
    return version.split("+", 1)[0]


def _refuse_other_model_parallel_sizes(where: str, saved: dict, current: dict) -> None:
    for key, what, flag in (("tensor_model_parallel_size", "tensor-parallel", "--tensor-model-parallel-size"),
                            ("pipeline_model_parallel_size", "pipeline-parallel",
                             "--pipeline-model-parallel-size"),
                            ("expert_model_parallel_size", "expert-parallel", "--expert-model-parallel-size")):
        if saved.get(key) is not None and saved[key] != current[key]:
            raise CheckpointError(
                f"{where} {what} size {saved[key]}, this run has {current[key]}; checkpoints are "
                f"resharded across data-parallel sizes only: resume with {flag} {saved[key]}")


def optimizer_kind(layout: dict) -> Optional[str]:
    """``"plain"`` (megatron's non-distributed optimizers) or ``"distributed"``; from the
    buckets for a checkpoint saved before it was recorded; None when unknown."""
    if layout.get("optimizer"):
        return layout["optimizer"]
    buckets = layout.get("buckets")
    if buckets is None:
        return None
    stages = buckets.values() if isinstance(buckets, dict) else [buckets]
    return "plain" if all(opt is None for stage in stages for opt in stage) else "distributed"


def converts(saved: dict, current: dict) -> bool:
    """The checkpoint holds a plain optimizer's state, which this run's distributed
    optimizer takes (``convert``)."""
    return optimizer_kind(saved) == "plain" and optimizer_kind(current) == "distributed"


def _refuse_other_optimizer(where: str, saved: dict, current: dict) -> None:
    then, now = optimizer_kind(saved), optimizer_kind(current)
    if then == "distributed" and now == "plain":
        raise CheckpointError(
            f"{where} the distributed optimizer, this run has megatron's plain one (no "
            "--use-distributed-optimizer, no --sdp4bit flag): resume with --use-distributed-optimizer (every "
            "--sdp4bit flag implies it; --sdp4bit-preset baseline keeps the layer with the exact collectives)")
    if converts(saved, current) and not saved.get("optimizer"):
        raise CheckpointError(
            f"{where} megatron's plain optimizer by an older version, which did not record which parameter "
            "its state belongs to, so this run's distributed optimizer (--use-distributed-optimizer, implied by "
            "every --sdp4bit flag) cannot take it: resume it without --use-distributed-optimizer and --sdp4bit "
            "flags (its next checkpoint records it)")
    dtype, now_dtype = saved.get("params_dtype"), current.get("params_dtype")
    if dtype and now_dtype and dtype != now_dtype:
        raise CheckpointError(f"{where} {dtype} parameters, this run has {now_dtype}: resume "
                              f"{'without' if dtype == 'float32' else 'with'} --bf16")


def _refuse_other_buckets(where: str, saved: dict, current: dict) -> None:
    stage, = current["buckets"]  # this rank's stage
    saved_buckets, buckets = saved.get("buckets"), current["buckets"][stage]
    if isinstance(saved_buckets, dict):
        saved_buckets = saved_buckets.get(stage)
    if saved_buckets is None or buckets is None or saved_buckets == buckets:
        return
    saved_dtypes = [b["dtypes"] for opt in saved_buckets if opt for b in opt]
    dtypes = [b["dtypes"] for opt in buckets if opt for b in opt]
    if saved_dtypes != dtypes or [o is None for o in saved_buckets] != [o is None for o in buckets]:
        raise CheckpointError(
            f"{where} parameter/gradient dtypes {saved_dtypes}, this run has {dtypes} "
            f"(--bf16 and the distributed optimizer must be as when it was saved)")
    hint, size = "", saved.get("bucket_size")
    if size != current.get("bucket_size"):
        hint = (f" (its DDP bucket size was {size}: pass --bucket-size {size})" if size else
                " (it had one bucket per buffer: resume without --overlap-grad-reduce)")
    raise CheckpointError(
        f"{where} optimizer buckets of {[b['numel_unpadded'] for opt in saved_buckets if opt for b in opt]} "
        f"elements, this run's are {[b['numel_unpadded'] for opt in buckets if opt for b in opt]}: "
        f"the model's shape or the bucketing differ{hint}")


def _warnings(where: str, saved: dict, current: dict) -> List[str]:
    warnings = []
    if saved.get("megatron_core") and release(saved["megatron_core"]) != release(current["megatron_core"]):
        warnings.append(f"warning: {where} megatron-core {saved['megatron_core']}, this run has "
                        f"{current['megatron_core']}; loading it (the checkpoint's contents are the same "
                        "in the supported releases)")
    ignored = ("ranks_per_node", "runner")  # where it ran, not which method
    old, new = saved.get("sdp4bit"), current.get("sdp4bit")
    if old is not None and new is not None:
        changed = [f"{k} {old.get(k)} -> {new.get(k)}" for k in new
                   if k not in ignored and old.get(k) != new.get(k)]
        if changed:
            streams = (" (the rounding streams continue the checkpoint's: its seed drew them)"
                       if old.get("seed") != new.get("seed") else "")
            warnings.append(f"warning: {where} SDP4Bit {preset_name(old)}, this run uses "
                            f"{preset_name(new)} ({', '.join(changed)}); training continues with this "
                            f"run's config{streams}")
    return warnings


def compare_layouts(directory: str, saved: dict, current: dict) -> Tuple[bool, List[str]]:
    """(reshard, warnings): whether the data-parallel size differs (then the state is
    resharded) and one line per harmless difference. A difference that cannot be
    loaded raises ``CheckpointError``, in one line saying what differs."""
    where = f"checkpoint {directory} was saved with"
    # First: another --seq-length or tokenizer also changes the model's shape.
    data_warnings = compare_data(directory, saved, current.get("data"))
    _refuse_other_model_parallel_sizes(where, saved, current)
    compare_models(directory, saved.get("model"), current.get("model"))
    _refuse_other_optimizer(where, saved, current)
    if not converts(saved, current):  # a plain optimizer has no buckets to compare
        _refuse_other_buckets(where, saved, current)
    reshard = saved["data_parallel_size"] != current["data_parallel_size"]
    if reshard and (current["tensor_model_parallel_size"] != 1 or current["pipeline_model_parallel_size"] != 1
                    or current.get("expert_model_parallel_size", 1) != 1):
        # (reshard.py takes the model from rank 0's file: with EP > 1 it holds some experts only)
        raise CheckpointError(
            f"{where} data-parallel size {saved['data_parallel_size']}, this run has "
            f"{current['data_parallel_size']}; resharding is supported with TP = PP = EP = 1 only: "
            f"resume with {saved['data_parallel_size']} data-parallel ranks")
    return reshard, data_warnings + _warnings(where, saved, current)
