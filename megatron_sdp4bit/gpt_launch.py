"""What ``scripts/pretrain_gpt.sh SIZE [flags]`` decides before torchrun starts anything.

    python -m megatron_sdp4bit.gpt_launch CONFIGS_DIR SIZE [driver flags]

prints torchrun's node flags (one line of words) on stdout and the layout on stderr
(``GPT-6.7b: TP 4 x PP 1 x DP 8 on 4 node(s) x 8 GPUs``), or exits 2 with one line
saying what to change: a size without a config; ``--config`` (the size's file is
the config: a second one would silently replace it); any flag the driver would
refuse (its own parser and layout rules read them, so a typo is said once, here,
rather than by every rank after start-up); the node variables (``GPUS_PER_NODE``,
``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``: several nodes need the
first node's address and each node's rank, or every node would wait for a
rendezvous on its own localhost); tensor parallelism across nodes. One node without
``MASTER_ADDR``/``MASTER_PORT`` gets torchrun's ``--standalone`` (a free port), so
two jobs on one machine do not both take port 29500.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import List, Mapping, Optional, Sequence

from megatron_sdp4bit.jobs import NodeRendezvous, torchrun_command

PROG = "pretrain_gpt.sh"


class LaunchError(ValueError):
    """What the script refuses; the message says what to change."""


def _env_int(env: Mapping[str, str], name: str, default: Optional[int], minimum: int) -> Optional[int]:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise LaunchError(f"{name}={value!r} is not an integer >= {minimum}")
    return number


def config_path(configs: str, size: str) -> str:
    path = os.path.join(configs, f"gpt_{size}.yaml")
    if not os.path.isfile(path):
        sizes = sorted(name[len("gpt_"):-len(".yaml")] for name in os.listdir(configs)
                       if name.startswith("gpt_") and name.endswith(".yaml"))
        raise LaunchError(f"no config for size '{size}' ({path}): choose one of {', '.join(sizes)}")
    return path


def rendezvous(env: Mapping[str, str]) -> Optional[NodeRendezvous]:
    """Where the nodes meet; None: one node on a free port (``--standalone``)."""
    nnodes = _env_int(env, "NNODES", 1, 1)
    node_rank = _env_int(env, "NODE_RANK", None, 0)
    port = _env_int(env, "MASTER_PORT", None, 1)
    address = env.get("MASTER_ADDR") or None
    if nnodes > 1 and (address is None or node_rank is None):
        raise LaunchError(f"NNODES={nnodes} needs MASTER_ADDR (the first node's address, the same on every node) "
                          f"and NODE_RANK (this node's, 0 to {nnodes - 1}); without them every node would wait "
                          "for the others on its own localhost")
    if (node_rank or 0) >= nnodes:
        raise LaunchError(f"NODE_RANK={node_rank} is not below NNODES={nnodes}: the nodes are 0 to {nnodes - 1}")
    if port is not None and port > 65535:
        raise LaunchError(f"MASTER_PORT={port} is not a port (1 to 65535)")
    if nnodes == 1 and address is None and port is None:
        return None
    return NodeRendezvous(nnodes, node_rank or 0, address or "127.0.0.1", port or 29500)


def _gpus(env: Mapping[str, str]) -> int:
    gpus = _env_int(env, "GPUS_PER_NODE", None, 1)
    if gpus is None:
        import torch

        gpus = max(torch.cuda.device_count(), 1)
    return gpus


def plan(configs: str, size: str, argv: Sequence[str], env: Mapping[str, str]) -> tuple:
    """(torchrun's node flags, the layout line), or ``LaunchError``."""
    with warnings.catch_warnings():  # megatron-core's about Apex and Transformer Engine, at import
        warnings.simplefilter("ignore")
        from megatron_sdp4bit.training.arguments import ArgumentError, parse_args
        from megatron_sdp4bit.training.distributed import parallel_layout

    config = config_path(configs, size)
    if any(word == "--config" or word.startswith("--config=") for word in argv):
        raise LaunchError(f"--config: {PROG} {size} reads {config}, which another --config would replace: pass "
                          f"the flags to change, or run the driver on your file (torchrun ... -m "
                          "megatron_sdp4bit.pretrain --config FILE)")
    nodes, gpus = rendezvous(env), _gpus(env)
    try:
        args = parse_args(["--config", config, *argv])
        tp = args.tensor_model_parallel_size
        if gpus % tp:
            raise LaunchError(f"{size}: --tensor-model-parallel-size {tp} does not divide the {gpus} GPUs of a "
                              "node (tensor parallelism stays inside a node); set GPUS_PER_NODE or pass another "
                              "size")
        layout = parallel_layout(args, (nodes.nnodes if nodes else 1) * gpus)
    except ArgumentError as error:
        raise LaunchError(str(error)) from None
    flags = torchrun_command(gpus, rendezvous=nodes)[3:]
    return flags, (f"GPT-{size}: {layout.describe()} on {nodes.nnodes if nodes else 1} node(s) x {gpus} GPUs")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configs, size, rest = argv[0], argv[1], argv[2:]
    try:
        flags, layout = plan(configs, size, rest, os.environ)
    except LaunchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return 2
    print(layout, file=sys.stderr, flush=True)
    print(" ".join(flags), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
