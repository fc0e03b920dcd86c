"""Checkpoints: every rank saves its own shard; writes are atomic and verified.

Layout (Megatron-LM-like)::

    SAVE/latest_checkpointed_iteration.txt       the newest complete checkpoint
    SAVE/iter_0000020/rank_00000.pt              one torch.save file per rank
    SAVE/iter_0000020/manifest.json              written last: layout, files, sizes, SHA-256

Each rank file holds the model's state dict (data-parallel rank 0 only: the
weights are identical across data-parallel ranks), the distributed optimizer's
non-parameter state and this rank's parameter shards (fp32 main weights, Adam
moments) in megatron's "dp_reshardable" form (a plain optimizer's whole state
and the names of the params it belongs to), the learning-rate scheduler, the
iteration (the data position follows from it), every RNG state (python, numpy,
torch, megatron's tracker, the SDP4Bit quantizers') and the patch layer's own state.

One module per concern:

- ``rng_state``: the RNG states;
- ``run_layout``: what a checkpoint records about the run's layout (world, data-,
  tensor- and pipeline-parallel sizes, megatron-core version, SDP4Bit config,
  the optimizer's buckets), and whether another run may load it (refused in one
  line, loaded with a warning, or resharded);
- ``training_data``: what decides the training samples a run reads (seed,
  sequence length, data and corpus, split, tokenizer, global batch size, the
  samples before the checkpoint), recorded with the layout; the one rule that
  refuses a resume that would train on other samples;
- ``manifest``: each file's size and SHA-256, verified collectively before
  anything is loaded; a damaged latest checkpoint names the bad file and the
  newest earlier checkpoint that verifies, which ``fallback`` (``--load-fallback``)
  loads instead;
- ``save``: atomic saves (``iter_X.tmp``, the manifest last, then the rename,
  then the tracker file);
- ``reshard``: loading under another data-parallel size;
- ``convert``: loading a plain optimizer's checkpoint into the distributed optimizer;
- ``model_record``: the flags that shaped the model, recorded and compared;
- ``overrides``: the schedule and Adam settings a checkpoint holds too;
- ``load``: the collective load, agreed between the ranks;
- ``folders``: what ``--load`` and ``--save`` name: the checkpoint a resume starts
  from (a ``--save`` folder's latest, one checkpoint of it, or nothing yet when
  ``--load`` is ``--save``), and a ``--save`` whose checkpoints a run would
  replace, refused.
"""
from megatron_sdp4bit.training.checkpoint.common import LATEST, MANIFEST, CheckpointError
from megatron_sdp4bit.training.checkpoint.folders import ResumePlan, check_save_folder, plan_resume, same_folder
from megatron_sdp4bit.training.checkpoint.run_layout import compare_layouts, current_layout
from megatron_sdp4bit.training.checkpoint.load import latest_iteration, load_checkpoint
from megatron_sdp4bit.training.checkpoint.manifest import (
    check_files, choose_checkpoint, file_digest, read_manifest, verify, write_manifest)
from megatron_sdp4bit.training.checkpoint.rng_state import rng_state, set_rng_state
from megatron_sdp4bit.training.checkpoint.save import check_writable, save_checkpoint
from megatron_sdp4bit.training.checkpoint.training_data import TrainingData, compare_data

__all__ = [
    "LATEST", "MANIFEST", "CheckpointError",
    "ResumePlan", "check_save_folder", "plan_resume", "same_folder",
    "compare_layouts", "current_layout",
    "latest_iteration", "load_checkpoint",
    "check_files", "choose_checkpoint", "file_digest", "read_manifest", "verify", "write_manifest",
    "rng_state", "set_rng_state",
    "check_writable", "save_checkpoint",
    "TrainingData", "compare_data",
]
