"""The Megatron-LM routes: the launcher and the pretrain_gpt.py patch.

Tests that need a Megatron-LM checkout (tag core_v0.16.1, with its Python
requirements installed) read its path from MEGATRON_LM_PATH and skip without it;
nothing from Megatron-LM is part of this repository.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APPLY = os.path.join(ROOT, "scripts", "apply_patches.sh")
MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
needs_megatron_lm = pytest.mark.skipif(
    not MEGATRON_LM or not os.path.isfile(os.path.join(MEGATRON_LM or "", "pretrain_gpt.py")),
    reason="set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.16.1) to run this test",
)

PROBE = textwrap.dedent("""
    import megatron.training.initialize as initialize
    from megatron_sdp4bit.megatron import patch
    args = initialize.parse_args()
    print("PROBE", args.sdp4bit, args.sdp4bit_grad_mode, args.num_layers, patch.is_installed(),
          patch.current_config().ranks_per_node if patch.is_installed() else None)
""")


def _run(cmd, **kwargs):
    env = dict(os.environ, PYTHONWARNINGS="ignore", **kwargs.pop("env", {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, **kwargs)


def test_apply_patches_refuses_a_tree_it_does_not_fit(tmp_path):
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "pretrain_gpt.py").write_text("print('not the script the patch was made for')\n")
    result = _run(["bash", APPLY, str(tmp_path)])
    assert result.returncode == 1
    assert "does not fit" in result.stderr and "core_v0.16.1" in result.stderr
    assert (tmp_path / "pretrain_gpt.py").read_text().startswith("print(")  # unchanged


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
    assert result.returncode != 0 and "no such script" in result.stderr


@needs_megatron_lm
def test_apply_patches_on_megatron_lm(tmp_path):
    tree = tmp_path / "Megatron-LM"
    (tree / "megatron" / "training").mkdir(parents=True)
    shutil.copy(os.path.join(MEGATRON_LM, "pretrain_gpt.py"), tree / "pretrain_gpt.py")
    first = _run(["bash", APPLY, str(tree)])
    assert first.returncode == 0 and "applied:" in first.stdout, first.stderr
    patched = (tree / "pretrain_gpt.py").read_text()
    assert "install_before_model(partial(model_provider, gpt_builder))" in patched
    assert "extend_args_provider(" in patched
    again = _run(["bash", APPLY, str(tree)])
    assert again.returncode == 0 and "already applied" in again.stdout
    assert (tree / "pretrain_gpt.py").read_text() == patched
    compile(patched, "pretrain_gpt.py", "exec")


@needs_megatron_lm
def test_launcher_extends_megatron_lm_parser_and_installs(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(PROBE)
    result = _run([sys.executable, "-m", "megatron_sdp4bit.launch", str(script),
                   "--num-layers", "2", "--sdp4bit", "--sdp4bit-grad-mode", "tlq",
                   "--sdp4bit-ranks-per-node", "2"],
                  env={"PYTHONPATH": MEGATRON_LM})
    assert result.returncode == 0, result.stderr[-3000:]
    line = [l for l in result.stdout.splitlines() if l.startswith("PROBE")][0]
    assert line.split()[1:] == ["True", "tlq", "2", "True", "2"]
