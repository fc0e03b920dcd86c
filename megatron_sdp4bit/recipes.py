"""The small GPT recipes that ``make train`` and the scripts run, as driver flags.

The paper's model sizes are ``configs/gpt_*.yaml`` (``--config``); these are the
small models that train in minutes on a few CPU cores on the embedded corpus (and
the GPU check's), each the flags of one study. ``Recipe.flags()`` writes them in
one fixed order, which is the order the studies' results record: ``make train``'s
shipped exact-collective reference and the accuracy study's fingerprint are made
from these lists, so a change here asks for both to be made again (``make train``
and ``scripts/reproduce_accuracy.py`` say so).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

# Flags in the order Recipe.flags() writes them: (field, driver flag).
_VALUED = (
    ("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"), ("seq_length", "--seq-length"),
    ("micro_batch_size", "--micro-batch-size"), ("global_batch_size", "--global-batch-size"),
    ("train_iters", "--train-iters"), ("lr", "--lr"), ("min_lr", "--min-lr"),
    ("lr_warmup_iters", "--lr-warmup-iters"), ("weight_decay", "--weight-decay"),
    ("clip_grad", "--clip-grad"),
)
_LOGGING = (("log_interval", "--log-interval"), ("eval_interval", "--eval-interval"),
            ("eval_iters", "--eval-iters"), ("split", "--split"))


@dataclass(frozen=True)
class Recipe:
    """A GPT, its batch and schedule. A field left ``None`` writes no flag (the
    driver's default, or a flag the caller adds); ``extra`` is written last."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: Optional[int] = None
    train_iters: Optional[int] = None
    lr: Optional[str] = "1e-3"
    min_lr: Optional[str] = "1e-4"
    lr_warmup_iters: Optional[int] = None
    weight_decay: Optional[str] = "0.1"
    clip_grad: Optional[str] = "1.0"
    distributed_optimizer: bool = True
    """``--use-distributed-optimizer`` (SDP4Bit's setting: sharded data parallelism)."""
    log_interval: Optional[int] = None
    eval_interval: Optional[int] = None
    eval_iters: Optional[int] = None
    split: Optional[str] = "969,30,1"
    extra: Tuple[str, ...] = ()

    def flags(self) -> List[str]:
        out: List[str] = []
        for name, flag in _VALUED:
            if getattr(self, name) is not None:
                out += [flag, str(getattr(self, name))]
        if self.distributed_optimizer:
            out.append("--use-distributed-optimizer")
        for name, flag in _LOGGING:
            if getattr(self, name) is not None:
                out += [flag, str(getattr(self, name))]
        return out + [str(flag) for flag in self.extra]

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)

    def under(self, extra: List[str]) -> "Recipe":
        """This recipe for a command line that adds ``extra`` after its flags: a warm-up
        the recipe sets follows ``--train-iters`` / ``--lr-decay-iters`` of ``extra``
        (the same fraction of the decay) unless ``extra`` sets a warm-up itself, so a
        shorter run is not refused for a warm-up the user never wrote. Without such
        flags it is this recipe, flag for flag."""
        given = flag_values(extra)
        if self.lr_warmup_iters is None or not self.train_iters or "--lr-warmup-iters" in given:
            return self
        if "--lr-warmup-fraction" in given:  # iterations would win over the user's fraction
            return self.replace(lr_warmup_iters=None)
        decay = given.get("--lr-decay-iters", given.get("--train-iters"))
        if decay is None or not decay.isdigit():
            return self
        return self.replace(lr_warmup_iters=self.lr_warmup_iters * int(decay) // self.train_iters)


def flag_values(argv: List[str]) -> dict:
    """``--flag value`` and ``--flag=value`` of a command line, the last one winning."""
    values = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--") and "=" in arg:
            flag, value = arg.split("=", 1)
            values[flag] = value
        elif arg.startswith("--"):
            follows = argv[i + 1] if i + 1 < len(argv) else "--"
            values[arg] = "" if follows.startswith("--") else follows  # "": a switch
    return values


def hidden_flags(flags: List[str], extra: List[str]) -> dict:
    """The ``--flag value`` pairs of ``flags`` that ``extra`` does not set: what a
    recipe passes that the user never wrote."""
    given = flag_values(extra)
    return {flag: value for flag, value in flag_values(flags).items() if flag not in given}


MAKE_TRAIN = Recipe(
    num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128, micro_batch_size=4,
    global_batch_size=16, train_iters=200, lr_warmup_iters=10, log_interval=10,
    eval_interval=50, eval_iters=4)
"""``make train`` (megatron_sdp4bit.demo): 5.3 M parameters, 200 steps of 16 x 128 tokens,
on 4 CPU ranks as 2 emulated nodes x 2. fp32 parameters: most laptop and server CPUs
have no bf16 matrix units, and there a bf16 step is ~15x slower (a 2-core AMD EPYC:
15 s per step in bf16, 1 s in fp32); add ``--bf16`` where the CPU has them."""
MAKE_TRAIN_RANKS, MAKE_TRAIN_RANKS_PER_NODE = 4, 2

SLOW_LINK = MAKE_TRAIN.replace(
    train_iters=None, lr_warmup_iters=2, distributed_optimizer=False, log_interval=1,
    eval_interval=100000, eval_iters=1, extra=("--no-progress-bar",))
"""``scripts/bench_slow_link.py``: ``make train``'s model, every step logged and no
evaluation until the end (one batch), so every logged step is a training step; the
presets add the optimizer flags, the script the iterations and dtype."""

ACCURACY_CPU = Recipe(
    num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, micro_batch_size=4,
    global_batch_size=16, train_iters=400, lr_warmup_iters=20, log_interval=10,
    eval_interval=50, eval_iters=16, extra=("--default-corpus-mb", "8"))
"""``scripts/reproduce_accuracy.py --recipe cpu``: a 2 x 128 GPT (1.46 M parameters) in
fp32, 400 steps of 16 x 128 tokens on 4 CPU ranks as 2 emulated nodes x 2. Small enough
that 7 configurations x 3 seeds run within 2 hours on 2 cores, long enough that the
model is well past its first fast descent, where differences between the collectives
have had time to add up. Validation on 16 batches (32 K tokens) every 50 steps keeps
the noise of one evaluation below the seed-to-seed spread."""
ACCURACY_CPU_RANKS, ACCURACY_CPU_RANKS_PER_NODE = 4, 2

ACCURACY_CPU_OUTLIERS = MAKE_TRAIN.replace(
    train_iters=400, lr="1e-2", min_lr="1e-3", lr_warmup_iters=20, eval_iters=16,
    extra=("--default-corpus-mb", "8"))
"""``scripts/reproduce_accuracy.py --recipe cpu-outliers``: where the Hadamard rotation
has something to do. ``make train``'s 4 x 256 GPT (5.3 M parameters, fp32, 4 CPU ranks
as 2 emulated nodes x 2) at a 10x higher learning rate, 400 steps: measured by
``diagnostics.gradient_outliers`` (docs/results.md, setting 5), this learning rate
alone turns the inter-node hop's 4-bit gradient groups heavy-tailed from about step 50
on (crest median 4.3-5.5, TLq's 4-bit error 0.22-0.29 against TLq-HS's 0.16-0.18),
as in the paper's setting, while ``ACCURACY_CPU``'s stay Gaussian-like. It trains
worse than the 1e-3 recipes: it buys outliers, not a better model. Weight decay 0.1
stays, as in the paper. About 8 minutes a run on 2 cores."""

SOAK = ACCURACY_CPU.replace(
    train_iters=None, lr_warmup_iters=None, log_interval=None, eval_interval=None,
    eval_iters=None, extra=("--default-corpus-mb", "8", "--seed", "1234"))
"""``scripts/soak.py``: the accuracy study's model; the soak sets the length, warm-up,
logging and evaluation of each of its jobs."""

STEP_WORK = Recipe(
    num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, micro_batch_size=2,
    lr=None, min_lr=None, weight_decay=None, clip_grad=None, eval_interval=100000,
    eval_iters=1, split="90,10,0",
    extra=("--bf16", "--default-corpus-mb", "1", "--no-progress-bar"))
"""``scripts/count_step_work.py``: one rank, bf16, what one step asks of the device."""


def gpu_check_recipe(num_layers: int, hidden_size: int, num_attention_heads: int,
                     seq_length: int, micro_batch_size: int, train_iters: int,
                     log_interval: int, data_parallel: int = 1) -> Recipe:
    """``scripts/gpu_check_steps.py``'s driver runs: bf16, the global batch one
    micro-batch per data-parallel rank, one evaluation batch after the end."""
    return Recipe(
        num_layers, hidden_size, num_attention_heads, seq_length, micro_batch_size,
        global_batch_size=micro_batch_size * data_parallel, train_iters=train_iters,
        lr="6e-4", min_lr=None, weight_decay=None, clip_grad=None, log_interval=log_interval,
        eval_interval=10 * train_iters, eval_iters=1, split="95,5,0",
        extra=("--max-position-embeddings", str(seq_length), "--bf16"))
