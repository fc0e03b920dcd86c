"""Flags of the pre-training driver: Megatron-LM's names and meanings, plus SDP4Bit's.

``parse_args(argv)`` reads ``--config FILE.yaml`` first (keys are flag names with
dashes or underscores), then the command line, which overrides the file. Unknown
flags, unknown YAML keys and contradictory values are errors that name the flag.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional, Sequence

from megatron_sdp4bit.data.cache import CACHE_CONTENTS, CACHE_ENV
from megatron_sdp4bit.data.splits import split_weights
from megatron_sdp4bit.data.tokenizer_types import TOKENIZER_TYPES
from megatron_sdp4bit.megatron.args import SDP4BitFlagError, add_sdp4bit_args, config_from_args
from megatron_sdp4bit.training.config_file import ConfigFile, nearest_flag, read_config
from megatron_sdp4bit.training.signals import SIGNALS


class ArgumentError(ValueError):
    """A flag is unknown, malformed or contradicts another one."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print and exit(2); we want a clear exception
        raise ArgumentError(message)


def _number(kind, low=None, high=None, low_open=False, high_open=False):
    """argparse type: a finite ``kind`` (int or float) in a range; its error says which.

    ``nan`` and ``inf`` parse as floats but are never a learning rate or a size.
    """
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high}")
    wanted = f"{'an integer' if kind is int else 'a finite number'}{' ' if bounds else ''}{' and '.join(bounds)}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        if (not math.isfinite(value)
                or (low is not None and (value < low or (low_open and value == low)))
                or (high is not None and (value > high or (high_open and value == high)))):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _split(text: str) -> str:
    """argparse type of ``--split``: checked here (megatron-core reads it again)."""
    try:
        split_weights(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).replace(f"--split {text!r}", repr(text), 1)) from None
    return text


_POSITIVE_INT = _number(int, 1)
_NON_NEGATIVE_INT = _number(int, 0)
_POSITIVE = _number(float, 0, low_open=True)
_NON_NEGATIVE = _number(float, 0)
_PROBABILITY = _number(float, 0, 1, high_open=True)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=_POSITIVE_INT, default=2, help="transformer layers")
    m.add_argument("--hidden-size", type=_POSITIVE_INT, default=128, help="width of the model")
    m.add_argument("--num-attention-heads", type=_POSITIVE_INT, default=4, help="must divide --hidden-size")
    m.add_argument("--ffn-hidden-size", type=_POSITIVE_INT, default=None, help="default 4 x hidden size")
    m.add_argument("--seq-length", type=_POSITIVE_INT, default=128, help="tokens per sample")
    m.add_argument("--max-position-embeddings", type=_POSITIVE_INT, default=None, help="default --seq-length")
    m.add_argument("--hidden-dropout", type=_PROBABILITY, default=0.0, help="dropout probability")
    m.add_argument("--attention-dropout", type=_PROBABILITY, default=0.0, help="dropout probability")
    m.add_argument("--init-method-std", type=_POSITIVE, default=0.02, help="std of the initial weights")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="an output layer of its own (default: the word embeddings, tied)")
    m.add_argument("--transformer-impl", choices=("auto", "local", "transformer_engine"), default="auto",
                   help="layer spec: Transformer Engine when installed (auto), or megatron's local one")
    m.add_argument("--num-experts", type=_POSITIVE_INT, default=None,
                   help="mixture of experts: experts per MLP layer (megatron-core's MoE layer); "
                        "default: dense MLPs")
    m.add_argument("--moe-router-topk", type=_POSITIVE_INT, default=2,
                   help="experts each token is routed to (with --num-experts)")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=_POSITIVE_INT, default=4, help="samples per forward pass per rank")
    t.add_argument("--global-batch-size", type=_POSITIVE_INT, default=None, help="default micro-batch x DP")
    t.add_argument("--train-iters", type=_POSITIVE_INT, default=100, help="iterations (optimizer steps)")
    t.add_argument("--lr", type=_POSITIVE, default=6e-4, help="peak learning rate")
    t.add_argument("--min-lr", type=_NON_NEGATIVE, default=None, help="default lr / 10")
    t.add_argument("--lr-decay-style", choices=("cosine", "linear", "constant"), default="cosine",
                   help="learning-rate decay after the warm-up")
    t.add_argument("--lr-decay-iters", type=_POSITIVE_INT, default=None, help="default --train-iters")
    t.add_argument("--lr-warmup-fraction", type=_number(float, 0, 1), default=0.01,
                   help="warm-up as a fraction of --lr-decay-iters (when --lr-warmup-iters is 0)")
    t.add_argument("--lr-warmup-iters", type=_NON_NEGATIVE_INT, default=0,
                   help="warm-up iterations; 0: --lr-warmup-fraction decides")
    t.add_argument("--weight-decay", type=_NON_NEGATIVE, default=0.1, help="AdamW's")
    t.add_argument("--adam-beta1", type=_PROBABILITY, default=0.9, help="Adam's beta1")
    t.add_argument("--adam-beta2", type=_PROBABILITY, default=0.95, help="Adam's beta2")
    t.add_argument("--adam-eps", type=_POSITIVE, default=1e-8, help="Adam's epsilon")
    t.add_argument("--clip-grad", type=_NON_NEGATIVE, default=1.0, help="gradient-norm clip; 0: none")
    t.add_argument("--max-consecutive-skipped-iters", type=_POSITIVE_INT, default=3,
                   help="stop (exit 3, saving nothing) after this many consecutive iterations "
                        "whose loss or gradients were not finite and were skipped")
    t.add_argument("--bf16", action="store_true", help="bf16 weights and activations (default: fp32)")
    t.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state (implied by --sdp4bit and by every --sdp4bit-* flag, "
                        "preset baseline included)")
    t.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce gradients during the backward pass (default: after it)")
    t.add_argument("--overlap-param-gather", action="store_true",
                   help="gather weights during the next forward pass (default: after the step)")
    t.add_argument("--bucket-size", type=_POSITIVE_INT, default=None,
                   help="elements per DDP bucket (default megatron's: one bucket without overlap)")
    t.add_argument("--seed", type=_NON_NEGATIVE_INT, default=1234, help="initial weights and the data order")
    t.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default nccl with GPUs, gloo without; gloo on GPUs lets several ranks "
                        "share a GPU (e.g. 4 data-parallel ranks on one), staging every "
                        "collective through host memory: for checks, not for speed")
    t.add_argument("--tensor-model-parallel-size", type=_POSITIVE_INT, default=1,
                   help="TP: ranks that split each layer's weights (Megatron-LM's meaning)")
    t.add_argument("--pipeline-model-parallel-size", type=_POSITIVE_INT, default=1,
                   help="PP: pipeline stages the layers are split into")
    t.add_argument("--expert-model-parallel-size", type=_POSITIVE_INT, default=1,
                   help="EP: ranks that split the experts (each holds --num-experts / EP), carved out "
                        "of the data-parallel ranks as in Megatron-LM; the experts' gradients and "
                        "weights go over the expert-data-parallel groups (DP / EP ranks each)")
    t.add_argument("--num-layers-per-virtual-pipeline-stage", type=_POSITIVE_INT, default=None,
                   help="layers per virtual pipeline stage: each PP stage holds (layers / PP) / this "
                        "interleaved model chunks (megatron's interleaved 1F1B schedule)")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("data")
    d.add_argument("--data-path", nargs="*", default=None,
                   help="Megatron data prefixes (optionally weighted: W1 P1 W2 P2); "
                   "default: the embedded corpus (Python's standard library)")
    d.add_argument("--split", type=_split, default="969,30,1",
                   help="weights of the training, validation and test sets (Megatron-LM's); a "
                   "validation weight of 0 turns evaluation off")
    d.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="the tokenizer the --data-path data was preprocessed with (required with "
                   "it): GPT2BPETokenizer (with --vocab-file/--merge-file), HuggingFaceTokenizer "
                   "(with --tokenizer-model), or StdlibBPETokenizer (the embedded corpus's)")
    d.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (GPT2BPETokenizer)")
    d.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (GPT2BPETokenizer)")
    d.add_argument("--tokenizer-model", default=None, help="tokenizer.json or its folder (HuggingFaceTokenizer)")
    d.add_argument("--data-cache-path", default=None,
                   help=f"where the dataset index files go (default ${CACHE_ENV}/dataset_indices)")
    d.add_argument("--default-corpus-mb", type=_POSITIVE, default=None,
                   help="cap the embedded corpus at this many MB of text (default: all of it)")


def _add_logging_and_checkpoint_args(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("logging, evaluation, checkpoints")
    e.add_argument("--log-interval", type=_POSITIVE_INT, default=10)
    e.add_argument("--eval-interval", type=_POSITIVE_INT, default=50)
    e.add_argument("--eval-iters", type=_NON_NEGATIVE_INT, default=5, help="batches per evaluation; 0: none")
    e.add_argument("--save", default=None, help="checkpoint folder (one job at a time saves into it)")
    e.add_argument("--load", default=None,
                   help="resume from the folder --save wrote (its latest checkpoint) or one checkpoint of it "
                        "(FOLDER/iter_N); --load and --save the same new folder: start, then resume there")
    e.add_argument("--load-fallback", action="store_true",
                   help="when the latest checkpoint in --load is damaged, resume from the newest complete one")
    e.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on resume, train with this run's learning-rate schedule and Adam settings where "
                        "the checkpoint's differ (Megatron-LM's flag; the iteration count comes from it)")
    e.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on resume, keep the checkpoint's learning-rate schedule and Adam settings where "
                        "this run's flags differ (without either flag a difference is refused)")
    e.add_argument("--save-interval", type=_POSITIVE_INT, default=None,
                   help="save every this many iterations (default: at the end only)")
    e.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=None,
                   help="on SIGTERM, SIGINT (Ctrl-C), SIGHUP or --exit-signal (a scheduler's preemption), "
                        "or when torchrun dies, save at the next step boundary and stop with exit code "
                        "128 + the signal's number (Megatron-LM's flag); default: on with --save")
    e.add_argument("--exit-signal", choices=sorted(SIGNALS), default="SIGTERM",
                   help="a signal the exit-signal handler acts on besides SIGTERM, SIGINT and SIGHUP "
                        "(e.g. SIGUSR1, a scheduler's warning)")
    e.add_argument("--run-dir", default=None,
                   help="where metrics.jsonl, the loss plot and TensorBoard events go "
                   "(default runs/<timestamp>)")
    e.add_argument("--no-progress-bar", action="store_true",
                   help="no progress bar (there is none when stdout is not a terminal)")
    e.add_argument("--tensorboard-dir", default=None, help="default <run-dir>/tensorboard")


def _shows(default) -> bool:
    """Whether ``--help`` names a default: not for a switch's False, a None (no value)
    or argparse's SUPPRESS (0 is shown: ``is``, as 0 == False)."""
    return not (default is None or default is False or default == argparse.SUPPRESS)


class _HelpFormatter(argparse.HelpFormatter):
    """``--help`` names every flag's default: argparse's ArgumentDefaultsHelpFormatter
    would repeat the defaults that help texts state in words, and skips flags
    without a help text (``build_parser`` gives those one)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and _shows(action.default) and "default" not in text):
            text += (" " if text else "") + "(default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sdp4bit-pretrain", allow_abbrev=False, formatter_class=_HelpFormatter,
                description="GPT pre-training on megatron-core with SDP4Bit communication.",
                epilog=f"environment: {CACHE_ENV}, the cache folder (default ~/.cache/megatron_sdp4bit): "
                f"{CACHE_CONTENTS}; it must be writable the first time they are built.")
    p.add_argument("--config", default=None,
                   help="YAML file of flags, keys as flag names (num_layers: 12); the command line overrides it")
    _add_model_args(p)
    _add_training_args(p)
    _add_data_args(p)
    _add_logging_and_checkpoint_args(p)
    add_sdp4bit_args(p)
    for action in p._actions:  # a flag without help text still shows its default
        if action.help is None and _shows(action.default):
            action.help = "(default: %(default)s)"
    return p


def yaml_to_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags of the YAML file ``path`` as command-line words (``config_file``)."""
    try:
        return read_config(path, parser).argv
    except ValueError as error:
        raise ArgumentError(str(error)) from None


def _decide_evaluation(args: argparse.Namespace) -> None:
    """A training set of weight 0 is refused; a validation set of weight 0 turns
    evaluation off (``args.eval_iters`` 0), as in Megatron-LM, and
    ``args.no_evaluation`` says why (None: the run evaluates)."""
    train, valid, _ = split_weights(args.split)
    if train == 0:
        raise ArgumentError(f"--split {args.split} gives the training set weight 0, so there is nothing to "
                            "train on; give it weight, e.g. --split 98,2,0")
    args.no_evaluation = None
    if args.eval_iters == 0:
        args.no_evaluation = "--eval-iters 0"
    elif valid == 0:
        args.eval_iters = 0
        args.no_evaluation = f"--split {args.split} gives the validation set weight 0"


PATH_FLAGS = ("data_path", "vocab_file", "merge_file", "tokenizer_model", "data_cache_path", "save", "load",
              "run_dir", "tensorboard_dir")
"""Flags that name files or folders (``--data-path``'s weights are left as they are)."""


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_paths(args: argparse.Namespace) -> None:
    """An empty path (``--save "$CKPT"`` with CKPT unset) is refused: taken as no flag,
    it saved nothing (``--save``) or started from scratch (``--load``) without a word.
    ``~`` is the home folder, as the user meant: no shell expands it in a config file,
    in quotes, or after ``=`` (``--save=~/ck``), and a folder named ``~`` made in the
    working directory would hold the run's checkpoints where ``--load ~/ck`` never
    looks."""
    if args.data_path == []:  # `--data-path $DATA` with DATA unset: not the embedded corpus
        raise ArgumentError("--data-path was given no prefix (an empty variable?): pass the prefix of your "
                            "PREFIX.bin/PREFIX.idx files, or drop --data-path to train on the embedded corpus")
    for dest in PATH_FLAGS:
        value = getattr(args, dest)
        words = value if isinstance(value, list) else [value]
        if "" in words:
            raise ArgumentError(f"{_flag(dest)} was given an empty path (an empty variable?): pass the path, or "
                                f"drop {_flag(dest)}")
        if isinstance(value, list):
            setattr(args, dest, [os.path.expanduser(word) for word in value])
        elif value is not None:
            setattr(args, dest, os.path.expanduser(value))


def _check_experts(args: argparse.Namespace) -> None:
    """The mixture-of-experts flags against each other (the world is checked with the
    parallel layout, ``distributed.parallel_layout``)."""
    experts, parallel = args.num_experts, args.expert_model_parallel_size
    if experts is None:
        if parallel > 1:
            raise ArgumentError(f"--expert-model-parallel-size {parallel} splits the experts of a "
                                "mixture-of-experts model: add --num-experts, or drop it")
        return
    if args.moe_router_topk > experts:
        raise ArgumentError(f"--moe-router-topk {args.moe_router_topk} routes each token to more experts "
                            f"than --num-experts {experts}: lower it")
    if experts % parallel:
        raise ArgumentError(f"--num-experts {experts} is not divisible by --expert-model-parallel-size "
                            f"{parallel}: every expert-parallel rank holds as many experts")
    if args.tensor_model_parallel_size > 1:
        raise ArgumentError(
            f"--num-experts with --tensor-model-parallel-size {args.tensor_model_parallel_size}: megatron's "
            "MoE layer needs sequence parallelism beside tensor parallelism, which this driver does not "
            "set; use --tensor-model-parallel-size 1 (Megatron-LM's pretrain_gpt.py with "
            "--sequence-parallel runs MoE with TP)")


def _fill_defaults_and_validate(args: argparse.Namespace) -> argparse.Namespace:
    def bad(message):
        raise ArgumentError(message)

    _check_paths(args)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        bad(f"--seq-length {args.seq_length} is longer than --max-position-embeddings "
            f"{args.max_position_embeddings}; raise the latter or shorten the sequence")
    if args.hidden_size % args.num_attention_heads:
        bad(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    if args.min_lr > args.lr:
        bad(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    warmup = args.lr_warmup_iters or int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_decay_iters <= 0 or warmup >= args.lr_decay_iters:
        bad(f"--lr-warmup-iters/--lr-warmup-fraction give {warmup} warm-up iterations, not fewer "
            f"than --lr-decay-iters {args.lr_decay_iters} (default --train-iters); shorten the "
            "warm-up or lengthen the decay")
    _decide_evaluation(args)
    if args.save_interval is not None and not args.save:
        bad("--save-interval needs --save DIR")
    if args.exit_signal_handler is None:  # a stop with somewhere to save saves
        args.exit_signal_handler = bool(args.save)
    if args.exit_signal != "SIGTERM" and not args.exit_signal_handler:  # the signal would end the run unheard
        bad(f"--exit-signal {args.exit_signal} is handled by the exit-signal handler, which is off "
            f"({'--no-exit-signal-handler' if args.save else 'no --save'}): add --save DIR "
            "(or --exit-signal-handler), or drop --exit-signal")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        bad("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each other: "
            "use this run's schedule or the checkpoint's, not both")
    _check_experts(args)
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        bad("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM)")
    try:
        args.sdp4bit_config = config_from_args(args)
    except SDP4BitFlagError as error:
        bad(str(error))
    if args.sdp4bit_config is not None:
        # Every preset, the exact baseline included, is the same optimizer with other
        # collectives: measured alike (bytes, replica check) and checkpoints compatible.
        args.use_distributed_optimizer = True
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        bad("--overlap-param-gather needs --use-distributed-optimizer")
    return args


def check_parallel_sizes(args: argparse.Namespace, world_size: int) -> None:
    """Batch sizes against the data-parallel size (known once torch.distributed is up)."""
    per_step = args.micro_batch_size * world_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {world_size} = {per_step}"
        )


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """``--config``'s flags, then the command line's; a mistake raises ``ArgumentError``,
    one line naming the flag and, for one the file sets, its file and line."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre, unknown = parser.parse_known_args(argv)
    flags = [word.split("=", 1)[0] for word in unknown if word.startswith("--")]
    if flags:  # a typo on the command line: name the flag it is closest to
        raise ArgumentError(f"unrecognized arguments: {' '.join(unknown)}{nearest_flag(flags[0], parser)}")
    if pre.config == "":
        raise ArgumentError("--config was given an empty path (an empty variable?): pass the YAML file, or drop "
                            "--config")
    try:
        config = read_config(os.path.expanduser(pre.config), parser) if pre.config else ConfigFile("")
    except ValueError as error:
        raise ArgumentError(str(error)) from None
    try:
        return _fill_defaults_and_validate(parser.parse_args(config.argv + argv))
    except ArgumentError as error:
        raise ArgumentError(config.where(str(error), argv)) from None
