"""Every megatron function the package wraps, replaces or copies is fingerprinted per release.

``megatron_fingerprints.json`` holds, for each supported megatron-core release, a hash of
each seam's code (``adapters/fingerprints.py``). When the installed release's code of one
differs, the first test fails with one line per function, naming it, the release and the
package's file that depends on it; a release missing from the table fails with a line
saying how to add it. The table is recorded from the wheels by
``scripts/megatron_fingerprints.py`` (docs/megatron.md).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os

import pytest

from megatron_sdp4bit.megatron import adapters
from megatron_sdp4bit.megatron.adapters import base
from megatron_sdp4bit.megatron.adapters.fingerprints import (
    ABSENT,
    TABLE,
    Seam,
    cpp_fingerprint,
    differences,
    installed_reader,
    python_fingerprint,
)

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPOSITORY, "megatron_sdp4bit")


def _table() -> dict:
    with open(os.path.join(REPOSITORY, TABLE), encoding="utf-8") as file:
        return json.load(file)


def _installed_release() -> str:
    """The installed megatron-core's release, read without importing it (0.19's
    ``megatron.core.__version__`` appends the git commit of the working directory)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path
        return adapters.megatron_version().split("+")[0]


def test_the_installed_release_has_the_recorded_code_at_every_seam():
    version = _installed_release()
    adapter = adapters.adapter_for(version, force=True)  # an unknown release: the newest adapter's seams
    lines = differences(version, _table().get(version), adapter.seams, installed_reader())
    assert not lines, "\n".join(lines)


def test_every_tested_release_is_recorded_for_exactly_its_adapters_seams():
    table = _table()
    assert set(adapters.tested_versions()) <= set(table), \
        f"releases without fingerprints: {sorted(set(adapters.tested_versions()) - set(table))}"
    for version, recorded in table.items():
        assert set(recorded) == {seam.name for seam in adapters.adapter_for(version).seams}, version


@pytest.mark.parametrize("minor", adapters.supported_minors())
def test_seams_are_named_once_and_point_at_the_package_files_that_use_them(minor):
    seams = adapters.adapter_for(minor).seams
    names = [seam.name for seam in seams]
    assert len(names) == len(set(names))
    for seam in seams:
        for where in seam.where.split(", "):
            assert os.path.isfile(os.path.join(PACKAGE, where)), (seam.name, where)


def _site_names(adapter) -> set:
    """``module:qualname`` of every megatron function the adapter's sites hand to the package."""
    def of(site) -> str:
        if isinstance(site, tuple):
            owner, name = site
            prefix = f"{owner.__module__}:{owner.__qualname__}" if isinstance(owner, type) \
                else f"{owner.__name__}:"
            return f"{prefix}.{name}" if isinstance(owner, type) else f"{prefix}{name}"
        return f"{site.__module__}:{site.__qualname__}"

    targets = adapter.patch_targets()
    names = {of((targets[owner], name)) for owner, name in base.SWAPPED_METHODS}
    core = adapter.cpu_backend_sites()
    names |= {of((core.rng.module, core.rng.get_state)), of((core.rng.module, core.rng.set_state)),
              of((core.rng.tracker, "add")), of((core.rng.tracker, "fork")), of(core.rng.seed_function)}
    names |= {of((cls, "__init__")) for cls in core.type_named_inits + core.inits}
    names |= {of(function) for function in core.type_named_functions + core.functions}
    names |= {of(site) for site in core.methods}
    training = adapter.cpu_training_sites()
    if training is not None:
        names |= {of(training.initialize_megatron), of(training.jit_warmup), of(training.device_arch),
                  of(training.pretrain), of(training.validate_args), of(training.checkpoint_worker),
                  of(training.optimizer_state_setter), of(training.optimizer_state_dict)}
        names |= {of(site) for site in training.one_device + training.rng_save_restore}
        names |= {of(function) for function in training.checkpoint_rng}
    if importlib.util.find_spec("megatron.training") is not None:  # the Megatron-LM routes
        routes = adapter.megatron_lm_sites()
        names |= {of(routes.compile_helpers), of(routes.save_checkpoint), of(routes.load_checkpoint),
                  of(routes.validate_args), of(getattr(routes.checkpointing, routes.base_loader)),
                  of(getattr(routes.training, routes.train)), of(getattr(routes.training, routes.training_log)),
                  of(getattr(routes.training, routes.log_printer))}
        import megatron.training.arguments as arguments  # megatron_lm/launcher.py wraps its parse_args

        names.add(of(arguments.parse_args))
    return names


def test_the_seams_cover_every_site_the_installed_adapter_names():
    adapter = adapters.current_adapter()
    missing = _site_names(adapter) - {seam.name for seam in adapter.seams}
    assert not missing, f"sites without a seam in the {adapter.minor} adapter: {sorted(missing)}"


# ------------------------------------------------------ the normalizers, on stand-ins

MODULE = '''
class Group:
    def start(self, x):
        """Docstring."""
        return x + 1  # a comment

if True:
    def helper(a, b=2):
        return a * b
'''


def test_a_fingerprint_ignores_docstrings_comments_and_formatting_but_not_code():
    reformatted = MODULE.replace('"""Docstring."""', '"""Another."""').replace("# a comment", "") \
        .replace("return x + 1", "return (x +\n                1)")
    assert python_fingerprint(reformatted, "Group.start") == python_fingerprint(MODULE, "Group.start")
    assert python_fingerprint(MODULE.replace("x + 1", "x + 2"), "Group.start") \
        != python_fingerprint(MODULE, "Group.start")
    assert python_fingerprint(MODULE, "helper") is not ABSENT  # defined inside an ``if``
    assert python_fingerprint(MODULE, "Group.finish") is ABSENT


def test_a_cpp_fingerprint_reads_the_definition_not_a_call():
    source = "int f(int a) { return g(a); } // f\nint g(int a) {\n  /* twice */ return 2 * a;\n}\n"
    assert cpp_fingerprint(source, "g") == cpp_fingerprint(source.replace("/* twice */", ""), "g")
    assert cpp_fingerprint(source, "g") != cpp_fingerprint(source.replace("2 * a", "3 * a"), "g")
    assert cpp_fingerprint(source, "h") is ABSENT


def test_a_changed_function_is_one_line_naming_it_the_release_and_the_file():
    seams = [Seam("megatron.core.m:Group.start", "replaces", "megatron/grad_sync.py"),
             Seam("megatron.core.m:helper", "wraps", "cpu_backend/core.py")]
    read = {"megatron/core/m.py": MODULE}.get
    recorded = {"megatron.core.m:Group.start": python_fingerprint(MODULE, "Group.start"),
                "megatron.core.m:helper": "0" * 16}
    lines = differences("0.20.0", recorded, seams, read)
    assert len(lines) == 1
    assert lines[0].startswith("megatron-core 0.20.0 changed megatron.core.m:helper (the package wraps "
                               "it in megatron_sdp4bit/cpu_backend/core.py)")
    assert "scripts/megatron_fingerprints.py" in lines[0]
    assert "no fingerprints" in differences("0.20.0", None, seams, read)[0]
