"""``megatron_sdp4bit.patching.Patches``: what it sets comes back exactly as it was."""
from __future__ import annotations

import sys
import types

import pytest

from megatron_sdp4bit.patching import Patches, PatchTargetMissing


class Base:
    def method(self):
        return "base"


class Child(Base):
    def own(self):
        return "own"


def test_restore_puts_back_the_very_object_and_deletes_what_was_inherited():
    own_before, own_dict = Child.own, dict(vars(Child))
    patches = Patches()
    assert patches.set(Child, "own", lambda self: "patched") is own_before
    assert patches.set(Child, "method", lambda self: "patched") is Base.method  # inherited
    assert Child().own() == Child().method() == "patched" and len(patches) == 2
    patches.restore()
    assert Child.own is own_before and Child().method() == "base"
    assert dict(vars(Child)) == own_dict  # no own ``method`` left behind
    patches.restore()  # a second restore changes nothing
    assert len(patches) == 0 and Child.own is own_before


def test_a_name_set_twice_comes_back_to_the_first_value():
    module = types.ModuleType("scratch")
    module.value = 1
    with Patches() as patches:
        patches.set(module, "value", 2)
        patches.set(module, "value", 3)
        assert module.value == 3
    assert module.value == 1


def test_the_context_manager_restores_when_the_block_raises():
    module = types.ModuleType("scratch")
    module.value = "original"
    with pytest.raises(ZeroDivisionError):
        with Patches() as patches:
            patches.set(module, "value", "patched")
            1 / 0
    assert module.value == "original"


def test_a_missing_attribute_is_refused_with_label_and_hint_and_nothing_changes():
    module = types.ModuleType("scratch")
    patches = Patches("CPU backend", "this backend supports megatron-core 0.16")
    with pytest.raises(PatchTargetMissing, match=r"^CPU backend: 'scratch' has no attribute 'gone'; "
                                                 r"this backend supports megatron-core 0\.16$"):
        patches.set(module, "gone", 1)
    assert len(patches) == 0 and not hasattr(module, "gone")
    patches.set(module, "new", 1, must_exist=False)
    patches.restore()
    assert not hasattr(module, "new")


def test_items_of_a_mapping_are_put_back_or_removed():
    mapping = {"present": "original"}
    with Patches() as patches:
        patches.set_item(mapping, "present", "patched")
        patches.set_item(mapping, "absent", "added")
        assert mapping == {"present": "patched", "absent": "added"}
    assert mapping == {"present": "original"}


def test_keep_undoes_what_happens_after_it():
    module, mapping = types.ModuleType("scratch"), {}
    with Patches() as patches:
        patches.keep(module, "bound_later")
        patches.keep_item(mapping, "imported_later")
        module.bound_later, mapping["imported_later"] = 1, 2  # what an import would do
    assert not hasattr(module, "bound_later") and mapping == {}


def test_set_everywhere_rebinds_every_copy_in_the_package_and_only_there(monkeypatch):
    def original():
        return "original"

    def replacement():
        return "replacement"

    package, first, second, outside = (types.ModuleType(name) for name in (
        "sdp4bit_scratch", "sdp4bit_scratch.a", "sdp4bit_scratch.b", "sdp4bit_scratch_other"))
    for module in (package, first, second, outside):
        module.f = original
        monkeypatch.setitem(sys.modules, module.__name__, module)
    second.copy = original  # ``from a import f as copy``
    with Patches() as patches:
        assert patches.set_everywhere(original, replacement, "sdp4bit_scratch") == 4
        assert package.f is first.f is second.f is second.copy is replacement
        assert outside.f is original
    assert package.f is first.f is second.f is second.copy is original
    with pytest.raises(PatchTargetMissing, match="no sdp4bit_scratch module binds"):
        Patches().set_everywhere(replacement, original, "sdp4bit_scratch")
