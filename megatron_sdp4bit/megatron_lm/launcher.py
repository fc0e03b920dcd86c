"""Run a Megatron-LM training script with SDP4Bit, without editing it.

    torchrun --nproc-per-node 8 -m megatron_sdp4bit.launch \
        /path/to/Megatron-LM/pretrain_gpt.py <Megatron-LM args> --sdp4bit

The launcher puts the script's folder first on ``sys.path`` (as ``python
script.py`` would, so the script's own Megatron-LM tree is the ``megatron``
imported), wraps Megatron-LM's ``parse_args`` so it accepts and acts on the
``--sdp4bit*`` flags, and runs the script as ``__main__``. While Megatron-LM parses
its flags, ``routes.py`` makes its dataset helpers available to this Python (a fresh
checkout) and refuses what would fail later. Every refusal, here too, is one line
from rank 0 and exit code 2. A rank ends when its torchrun dies (``launcher_watch``).
"""
from __future__ import annotations

import os
import runpy
import socket
import sys

from megatron_sdp4bit.launcher_watch import watch_launcher
from megatron_sdp4bit.megatron_lm.refusals import refuse
from megatron_sdp4bit.patching import Patches

USAGE = (
    "usage: python -m megatron_sdp4bit.launch PATH/TO/pretrain_gpt.py [Megatron-LM args] "
    "[--sdp4bit | --sdp4bit-* ...]"
)


def _teach_megatron_lm_parser() -> Patches:
    """Megatron-LM's ``parse_args`` wrapped to know and act on the SDP4Bit flags, until
    the returned ``Patches`` is restored."""
    try:
        import megatron.training.arguments as arguments
        import megatron.training.initialize as initialize
    except ImportError as exc:
        from megatron_sdp4bit.megatron.adapters import supported_minors

        refuse(f"megatron_sdp4bit.launch: cannot import Megatron-LM's megatron.training ({exc}). "
               "Pass the path of a script inside a Megatron-LM checkout of a supported release "
               f"(megatron-core {', '.join(supported_minors())}), and install that checkout's "
               "requirements.")
    from megatron_sdp4bit.megatron_lm.script_api import wrap_parse_args

    # initialize.py bound parse_args by name at import, so both names are wrapped
    # (up to 0.17; from 0.18 on initialize.py no longer imports it).
    patches = Patches("megatron_sdp4bit.launch")
    patches.set(arguments, "parse_args", wrap_parse_args(arguments.parse_args))
    if hasattr(initialize, "parse_args"):
        patches.set(initialize, "parse_args", wrap_parse_args(initialize.parse_args))
    return patches


def _help() -> str:
    """The usage line and the SDP4Bit flags with their allowed values (Megatron-LM's
    own flags are listed by ``pretrain_gpt.py --help`` through the launcher)."""
    import argparse

    from megatron_sdp4bit.megatron.args import add_sdp4bit_args

    parser = argparse.ArgumentParser(prog="python -m megatron_sdp4bit.launch", usage=USAGE[len("usage: "):],
                                     add_help=False)
    return add_sdp4bit_args(parser).format_help()


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun (or any launcher) sets, and Megatron-LM's process group (env://) reads."""


def _one_process_world_unless_launched(script: str) -> None:
    """Started without torchrun (none of ``LAUNCHER_VARIABLES`` set): a world of this one
    process on this machine, said in one line. Before, Megatron-LM died in
    ``init_process_group`` ("environment variable MASTER_ADDR expected") with a traceback."""
    if any(name in os.environ for name in LAUNCHER_VARIABLES):
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    print(f"megatron_sdp4bit.launch: not started by torchrun: one process (MASTER_ADDR=127.0.0.1 "
          f"MASTER_PORT={port}); SDP4Bit quantizes data-parallel collectives, which need several ranks: "
          f"torchrun --nproc-per-node N -m megatron_sdp4bit.launch {script} ...", flush=True)


def main(argv=None) -> None:
    watch_launcher(os.environ)  # first: a rank never outlives torchrun
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_help())
        raise SystemExit(0)
    # Every rank runs this: the refusals come once, from rank 0 (refusals.refuse).
    if not argv:
        refuse(f"megatron_sdp4bit.launch: name the training script to run. {USAGE}")
    script = os.path.abspath(argv[0])
    if os.path.isdir(script):
        refuse(f"megatron_sdp4bit.launch: {argv[0]} is a folder: name the script in it "
               f"(pretrain_gpt.py for Megatron-LM). {USAGE}")
    if not os.path.isfile(script):
        refuse(f"megatron_sdp4bit.launch: no such script: {argv[0]}. {USAGE}")
    _one_process_world_unless_launched(argv[0])
    sys.argv = [script] + argv[1:]
    sys.path.insert(0, os.path.dirname(script))
    taught = _teach_megatron_lm_parser()
    from megatron_sdp4bit.cpu_backend import cpu_training_requested, enable_cpu_training

    if cpu_training_requested():  # SDP4BIT_CPU=1, docs/cpu_backend.md
        try:
            enable_cpu_training()
        except RuntimeError as error:
            refuse(f"megatron_sdp4bit.launch: SDP4BIT_CPU=1: {error}")
    with taught:
        runpy.run_path(script, run_name="__main__")
