"""The dataset-helpers plan of the Megatron-LM routes (``megatron_lm/dataset_helpers.py``),
on a package made in a temporary folder that stands for a fresh checkout's
``megatron/core/datasets`` (its ``helpers.cpp``, no compiled module), beside the
installed megatron-core (which ships ``helpers_cpp`` built for this Python)."""
from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest

import megatron.core.datasets as installed_datasets
from megatron_sdp4bit.megatron_lm import dataset_helpers
from megatron_sdp4bit.patching import Patches

INSTALLED = os.path.dirname(installed_datasets.__file__)


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """``fresh_checkout.datasets``: a package holding the installed ``helpers.cpp`` and
    nothing compiled; ``edit()`` makes its source differ from the installed one."""
    folder = tmp_path / "fresh_checkout" / "datasets"
    folder.mkdir(parents=True)
    (folder.parent / "__init__.py").write_text("")
    (folder / "__init__.py").write_text("")
    with open(os.path.join(INSTALLED, "helpers.cpp"), "rb") as source:
        (folder / "helpers.cpp").write_bytes(source.read())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield types.SimpleNamespace(folder=str(folder), module="fresh_checkout.datasets.helpers_cpp",
                                edit=lambda: (folder / "helpers.cpp").write_text("// edited\n"))
    for name in [name for name in sys.modules if name.startswith("fresh_checkout")]:
        del sys.modules[name]


def test_helpers_that_import_are_used_as_they_are():
    plan = dataset_helpers.plan_dataset_helpers("megatron.core.datasets.helpers_cpp")
    assert (plan.how, plan.folder) == ("built", INSTALLED)


def test_a_checkout_with_the_installed_source_uses_the_installed_build(checkout):
    plan = dataset_helpers.plan_dataset_helpers(checkout.module)
    assert plan.how == "prebuilt" and plan.folder == checkout.folder
    assert os.path.dirname(plan.prebuilt) == INSTALLED and os.path.basename(plan.prebuilt).startswith("helpers_cpp")
    with Patches("test") as patches:
        owner = types.SimpleNamespace(compile_helpers=lambda: pytest.fail("megatron's make ran"))
        dataset_helpers.use_dataset_helpers(plan, (owner, "compile_helpers"), patches)
        owner.compile_helpers()  # nothing to compile: the module imports under the checkout's name
        module = importlib.import_module(checkout.module)
        assert module.__file__ == plan.prebuilt and hasattr(module, "build_sample_idx_int32")
        assert "(prebuilt)" in owner.compile_helpers.__doc__
    assert checkout.module not in sys.modules  # restored
    assert not [name for name in os.listdir(checkout.folder) if name.startswith("helpers_cpp")]


def test_another_source_without_pybind11_is_refused_naming_what_to_install(checkout, monkeypatch):
    checkout.edit()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pybind11" else real_find_spec(name, *a))
    with pytest.raises(dataset_helpers.HelpersUnavailable) as refused:
        dataset_helpers.plan_dataset_helpers(checkout.module)
    message = str(refused.value)
    assert "\n" not in message and os.path.join(checkout.folder, "helpers.cpp") in message
    assert f"pybind11 ({sys.executable} -m pip install pybind11)" in message


def test_another_source_with_the_build_tools_is_compiled_with_this_pythons_headers(checkout, monkeypatch):
    checkout.edit()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "pybind11" else real_find_spec(name, *a))
    monkeypatch.setattr(dataset_helpers.shutil, "which", lambda name: "/usr/bin/" + name)
    plan = dataset_helpers.plan_dataset_helpers(checkout.module)
    assert plan.how == "compile"
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        return types.SimpleNamespace(returncode=0, stdout="-I/include/of/this/python\n")

    monkeypatch.setattr(dataset_helpers.subprocess, "run", run)
    with Patches("test") as patches:
        owner = types.SimpleNamespace(compile_helpers=None)
        dataset_helpers.use_dataset_helpers(plan, (owner, "compile_helpers"), patches)
        owner.compile_helpers()
    assert commands[0] == [sys.executable, "-m", "pybind11", "--includes"]
    assert commands[1] == ["make", "-C", checkout.folder, "CPPFLAGS=-I/include/of/this/python",
                           f"LIBEXT={dataset_helpers._extension_suffix()}"]
