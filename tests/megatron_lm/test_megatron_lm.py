"""The Megatron-LM routes: the launcher and the pretrain_gpt.py patch.

Tests that need a Megatron-LM checkout (one of the patched tags, with its Python
requirements installed) read its path from MEGATRON_LM_PATH and skip without it;
nothing from Megatron-LM is part of this repository. The patch selection is tested
on synthetic trees: a package_info.py with a version, and a pretrain_gpt.py made of
the lines each patch expects (the patch tool finds hunks at any offset).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APPLY = os.path.join(ROOT, "scripts", "apply_patches.sh")
MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
needs_megatron_lm = pytest.mark.skipif(
    not MEGATRON_LM or not os.path.isfile(os.path.join(MEGATRON_LM or "", "pretrain_gpt.py")),
    reason="set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.16.1, core_v0.17.1, "
           "core_v0.18.2 or core_v0.19.0) to run this test",
)

PROBE = textwrap.dedent("""
    import megatron.training.arguments as arguments
    from megatron_sdp4bit.megatron import patch
    args = arguments.parse_args()
    print("PROBE", args.sdp4bit, args.sdp4bit_grad_mode, args.num_layers, patch.is_installed(),
          patch.current_config().ranks_per_node if patch.is_installed() else None)
""")


def _run(cmd, **kwargs):
    env = dict(os.environ, PYTHONWARNINGS="ignore", **kwargs.pop("env", {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, **kwargs)


# package_info.py version -> tag of the patch that must be chosen.
PATCHED_VERSIONS = {"0.16.1": "core_v0.16.1", "0.17.1": "core_v0.17.1",
                    "0.18.2": "core_v0.18.2", "0.19.1": "core_v0.19.0"}


def _tree(tmp_path, version, script):
    (tmp_path / "megatron" / "training").mkdir(parents=True, exist_ok=True)
    (tmp_path / "megatron" / "core").mkdir(parents=True, exist_ok=True)
    if version is not None:
        major, minor, patch_level = version.split(".")
        (tmp_path / "megatron" / "core" / "package_info.py").write_text(
            f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch_level}\nPRE_RELEASE = ''\n")
    (tmp_path / "pretrain_gpt.py").write_text(script)
    return tmp_path


def _old_side(patch_file):
    """The lines a patch expects (context and removed lines), hunk after hunk."""
    lines = []
    for line in open(patch_file).read().splitlines()[2:]:
        if line.startswith("@@"):
            lines.append("# filler between hunks")
        elif line.startswith((" ", "-")):
            lines.append(line[1:])
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("version", sorted(PATCHED_VERSIONS))
def test_apply_patches_picks_the_patch_of_the_checkouts_version(tmp_path, version):
    tag = PATCHED_VERSIONS[version]
    patch_file = os.path.join(ROOT, "patches", f"megatron-lm-{tag}-pretrain_gpt.patch")
    tree = _tree(tmp_path, version, _old_side(patch_file))
    first = _run(["bash", APPLY, str(tree)])
    assert first.returncode == 0, first.stderr
    assert f"applied: megatron-lm-{tag}-pretrain_gpt.patch" in first.stdout
    patched = (tree / "pretrain_gpt.py").read_text()
    assert "from megatron_sdp4bit.megatron_lm import extend_args_provider" in patched
    again = _run(["bash", APPLY, str(tree)])
    assert again.returncode == 0 and "already applied" in again.stdout
    assert (tree / "pretrain_gpt.py").read_text() == patched
    # A version whose patch edits other lines (0.16/0.17 wrap the model provider,
    # 0.18/0.19 install after parse_and_validate_args) does not fit: refused, unchanged.
    other = "0.19.1" if tag in ("core_v0.16.1", "core_v0.17.1") else "0.16.1"
    wrong = _tree(tmp_path / "wrong", other, _old_side(patch_file))
    refused = _run(["bash", APPLY, str(wrong)])
    assert refused.returncode == 1 and "does not fit" in refused.stderr
    assert PATCHED_VERSIONS[other] in refused.stderr and "Nothing was changed" in refused.stderr
    assert (wrong / "pretrain_gpt.py").read_text() == _old_side(patch_file)


@pytest.mark.parametrize("version", sorted(PATCHED_VERSIONS))
def test_apply_patches_revert_puts_back_the_tree_it_patched(tmp_path, version):
    """Before: no way back but git (undocumented). --revert on an unpatched tree changes
    nothing; on an edited one it is refused, changing nothing."""
    tag = PATCHED_VERSIONS[version]
    original = _old_side(os.path.join(ROOT, "patches", f"megatron-lm-{tag}-pretrain_gpt.patch"))
    tree = _tree(tmp_path, version, original)
    nothing = _run(["bash", APPLY, "--revert", str(tree)])
    assert nothing.returncode == 0 and "nothing to revert" in nothing.stdout, nothing.stderr
    assert _run(["bash", APPLY, str(tree)]).returncode == 0
    assert (tree / "pretrain_gpt.py").read_text() != original
    reverted = _run(["bash", APPLY, "--revert", str(tree)])
    assert reverted.returncode == 0 and f"reverted: megatron-lm-{tag}-pretrain_gpt.patch" in reverted.stdout
    assert (tree / "pretrain_gpt.py").read_text() == original
    assert sorted(os.listdir(tree)) == ["megatron", "pretrain_gpt.py"]  # no .orig / .rej left
    assert _run(["bash", APPLY, str(tree)]).returncode == 0  # patched, then a patched line edited
    edited = (tree / "pretrain_gpt.py").read_text().replace("import extend_args_provider", "import (extend_args_provider)")
    (tree / "pretrain_gpt.py").write_text(edited)
    refused = _run(["bash", APPLY, "--revert", str(tree)])
    assert refused.returncode == 1 and "Nothing was changed" in refused.stderr
    assert (tree / "pretrain_gpt.py").read_text() == edited


def test_apply_patches_usage_names_revert(tmp_path):
    for argv in ([], ["--revert"], ["--undo", str(tmp_path)], [str(tmp_path), str(tmp_path)]):
        result = _run(["bash", APPLY, *argv])
        assert result.returncode == 2 and "usage:" in result.stderr and "[--revert]" in result.stderr, argv


@pytest.mark.parametrize("version", ["0.15.0", "0.16.0", "0.19.2", "0.20.0"])
def test_apply_patches_refuses_any_other_version_changing_nothing(tmp_path, version):
    script = _old_side(os.path.join(ROOT, "patches", "megatron-lm-core_v0.16.1-pretrain_gpt.patch"))
    tree = _tree(tmp_path, version, script)
    result = _run(["bash", APPLY, str(tree)])
    assert result.returncode == 1
    assert f"is Megatron-LM {version}" in result.stderr and "Nothing was changed" in result.stderr
    assert (tree / "pretrain_gpt.py").read_text() == script


def test_apply_patches_refuses_a_tree_without_package_info(tmp_path):
    tree = _tree(tmp_path, None, "print('no version file')\n")
    result = _run(["bash", APPLY, str(tree)])
    assert result.returncode == 1 and "package_info.py is missing" in result.stderr
    assert (tree / "pretrain_gpt.py").read_text() == "print('no version file')\n"


def test_apply_patches_refuses_a_non_megatron_directory(tmp_path):
    result = _run(["bash", APPLY, str(tmp_path)])
    assert result.returncode == 1 and "does not look like a Megatron-LM checkout" in result.stderr


def _megatron_training_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(_megatron_training_importable(),
                    reason="Megatron-LM's megatron.training is importable here, so there is no error to see")
def test_launcher_without_megatron_lm_says_what_to_do(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(PROBE)
    result = _run([sys.executable, "-m", "megatron_sdp4bit.launch", str(script), "--sdp4bit"])
    assert result.returncode != 0
    assert "cannot import Megatron-LM's megatron.training" in result.stderr


def test_launcher_refuses_a_missing_script():
    result = _run([sys.executable, "-m", "megatron_sdp4bit.launch", "/no/such/pretrain_gpt.py"])
    assert result.returncode == 2
    assert result.stderr.startswith("error: megatron_sdp4bit.launch: no such script: /no/such/pretrain_gpt.py. "
                                    "usage: python -m megatron_sdp4bit.launch PATH/TO/pretrain_gpt.py")


@pytest.mark.parametrize("argv, words", [([], "name the training script to run"),
                                         (["/no/such/pretrain_gpt.py"], "no such script"),
                                         (["/"], "/ is a folder: name the script in it")])
def test_launcher_refusals_come_once_from_rank_0(monkeypatch, capsys, argv, words):
    """Before: every rank of a torchrun job printed the usage, and the job exited 1."""
    from megatron_sdp4bit import flag_errors
    from megatron_sdp4bit.megatron_lm import launcher

    waits = []
    monkeypatch.setattr(flag_errors.time, "sleep", waits.append)  # the other ranks' wait
    for rank in ("0", "1", "2"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as info:
            launcher.main(list(argv))
        assert info.value.code == 2
    assert capsys.readouterr().err.count(words) == 1
    assert waits == [flag_errors.LAUNCHER_GRACE_S] * 2


@needs_megatron_lm
def test_apply_patches_on_megatron_lm(tmp_path):
    tree = tmp_path / "Megatron-LM"
    (tree / "megatron" / "training").mkdir(parents=True)
    (tree / "megatron" / "core").mkdir(parents=True)
    shutil.copy(os.path.join(MEGATRON_LM, "pretrain_gpt.py"), tree / "pretrain_gpt.py")
    shutil.copy(os.path.join(MEGATRON_LM, "megatron", "core", "package_info.py"),
                tree / "megatron" / "core" / "package_info.py")
    first = _run(["bash", APPLY, str(tree)])
    assert first.returncode == 0 and "applied:" in first.stdout, first.stderr
    patched = (tree / "pretrain_gpt.py").read_text()
    assert ("install_before_model(partial(model_provider, gpt_builder))" in patched
            or "install_from_args(args)" in patched)
    assert "extend_args_provider(" in patched
    again = _run(["bash", APPLY, str(tree)])
    assert again.returncode == 0 and "already applied" in again.stdout
    assert (tree / "pretrain_gpt.py").read_text() == patched
    compile(patched, "pretrain_gpt.py", "exec")
    reverted = _run(["bash", APPLY, "--revert", str(tree)])
    assert reverted.returncode == 0 and "reverted:" in reverted.stdout, reverted.stderr
    with open(os.path.join(MEGATRON_LM, "pretrain_gpt.py")) as original:
        assert (tree / "pretrain_gpt.py").read_text() == original.read()


@needs_megatron_lm
def test_launcher_extends_megatron_lm_parser_and_installs(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(PROBE)
    result = _run([sys.executable, "-m", "megatron_sdp4bit.launch", str(script),
                   "--num-layers", "2", "--use-distributed-optimizer", "--sdp4bit", "--sdp4bit-grad-mode", "tlq",
                   "--sdp4bit-ranks-per-node", "2"],
                  env={"PYTHONPATH": MEGATRON_LM})
    assert result.returncode == 0, result.stderr[-3000:]
    line = [l for l in result.stdout.splitlines() if l.startswith("PROBE")][0]
    assert line.split()[1:] == ["True", "tlq", "2", "True", "2"]


def _checkout_release_is_installed() -> bool:
    """The CPU mode runs a checkout of the installed megatron-core's minor release whose
    adapter knows its loop (core_v0.19.0 with make test MCORE=0.19.2)."""
    from megatron_sdp4bit.megatron.adapters import current_adapter, minor_of

    fields = {}
    with open(os.path.join(MEGATRON_LM, "megatron", "core", "package_info.py")) as info:
        for line in info:
            match = re.match(r"(MAJOR|MINOR|PATCH) = (\d+)", line)
            if match:
                fields[match[1]] = match[2]
    adapter = current_adapter()
    return minor_of(f"{fields['MAJOR']}.{fields['MINOR']}") == adapter.minor and \
        adapter.cpu_training_sites() is not None


def _fresh_copy(tmp_path):
    """The checkout as a fresh clone has it: its top-level scripts and megatron/, nothing
    compiled (no helpers_cpp, no __pycache__)."""
    tree = tmp_path / "Megatron-LM"
    tree.mkdir()
    for name in os.listdir(MEGATRON_LM):
        if name.endswith(".py"):
            shutil.copy(os.path.join(MEGATRON_LM, name), tree / name)
    shutil.copytree(os.path.join(MEGATRON_LM, "megatron"), tree / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "helpers_cpp*"))
    return tree


PRETRAIN_GPT_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "6", "--lr", "3e-3", "--lr-decay-style", "constant", "--seed", "1234", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--transformer-impl", "local", "--bf16",
    "--use-distributed-optimizer", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--sdp4bit", "--sdp4bit-ranks-per-node", "2",
]


def _launch_pretrain_gpt(tmp_path, tree, args=PRETRAIN_GPT_ARGS, ranks=4, output_too=False):
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(port), "-m", "megatron_sdp4bit.launch",
           str(tree / "pretrain_gpt.py"), *args]
    result = _run(cmd, cwd=str(tmp_path), env={
        "SDP4BIT_CPU": "1", "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.Ee+-]+) \|", output)]
    return (losses, output) if output_too else losses


@needs_megatron_lm
@pytest.mark.slow
def test_a_fresh_checkout_trains_through_the_launcher_patched_or_not(tmp_path):
    """The checkout's own pretrain_gpt.py, unedited and then patched, through the launcher on
    4 CPU ranks (2 emulated nodes x 2): a fresh tree starts (its dataset helpers come from the
    installed build or are compiled for this Python), the patched tree adds the flags once
    (before: "conflicting option string: --sdp4bit"), and both train alike."""
    if not _checkout_release_is_installed():
        pytest.skip("the CPU mode runs a checkout of the installed megatron-core release "
                    "(core_v0.19.0 with make test MCORE=0.19.2)")
    tree = _fresh_copy(tmp_path)
    unedited = _launch_pretrain_gpt(tmp_path, tree)
    assert len(unedited) == 6 and unedited[-1] < unedited[0], unedited
    applied = _run(["bash", APPLY, str(tree)])
    assert applied.returncode == 0 and "applied:" in applied.stdout, applied.stderr
    assert _launch_pretrain_gpt(tmp_path, tree) == unedited


GPU_ONLY_FLAGS = ("--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                  "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion")


@needs_megatron_lm
@pytest.mark.slow
def test_the_checkouts_pretrain_gpt_trains_on_cpu_without_the_gpu_flags(tmp_path):
    """Before: without --transformer-impl local (0.19's default is Transformer Engine) every rank
    died with "TypeError: 'NoneType' object is not callable"; without the six fused-kernel
    flags, with AssertionErrors. The CPU mode sets them and rank 0 says so once."""
    if not _checkout_release_is_installed():
        pytest.skip("the CPU mode runs a checkout of the installed megatron-core release "
                    "(core_v0.19.0 with make test MCORE=0.19.2)")
    args = [arg for arg in PRETRAIN_GPT_ARGS if arg not in GPU_ONLY_FLAGS]
    args[args.index("--train-iters") + 1] = "3"
    losses, output = _launch_pretrain_gpt(tmp_path, _fresh_copy(tmp_path), args, ranks=2, output_too=True)
    assert len(losses) == 3, output[-4000:]
    said = [line for line in output.splitlines() if line.startswith("CPU mode (SDP4BIT_CPU=1): ")]
    assert len(said) == 1 and said[0].startswith("CPU mode (SDP4BIT_CPU=1): --transformer-impl local "
                                                 "--no-persist-layer-norm"), said


@needs_megatron_lm
def test_cpu_mode_on_a_release_whose_loop_it_does_not_know_is_one_line_from_rank_0(tmp_path):
    """SDP4BIT_CPU=1 with a checkout whose release has no CPU-training sites (core_v0.16.1):
    before, the refusal came from every rank."""
    if _checkout_release_is_installed():
        pytest.skip("the CPU mode knows this checkout's loop (it trains: the test above)")
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(port), "--monitor-interval", "0.1", "-m", "megatron_sdp4bit.launch",
           os.path.join(MEGATRON_LM, "pretrain_gpt.py"), *PRETRAIN_GPT_ARGS]
    result = _run(cmd, cwd=str(tmp_path), env={"SDP4BIT_CPU": "1", "OMP_NUM_THREADS": "1"})
    output = result.stdout + result.stderr
    ours = [line for line in output.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(ours) == 1, output[-4000:]
    assert ours[0].startswith("error: megatron_sdp4bit.launch: SDP4BIT_CPU=1: CPU training: not available")
    assert "exitcode  : 2" in output and output.count("Traceback") <= 1, output[-4000:]
