"""The per-release adapters: selection by version, and each release's differences.

The differences are checked on stand-ins for megatron's bucket groups (plain
objects with the fields each release has), so every adapter is tested in every
environment; the end-to-end tests (test_patch.py, test_cpu_backend.py) run the
installed release's adapter against real megatron-core.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_sdp4bit.megatron import adapters
from megatron_sdp4bit.megatron.adapters import base, v0_16, v0_17, v0_18, v0_19


@pytest.mark.parametrize("version, minor", [("0.16.1", "0.16"), ("0.19.2+82a15ab", "0.19"),
                                            ("0.17.0rc0", "0.17"), ("0.18.2", "0.18")])
def test_minor_of(version, minor):
    assert adapters.minor_of(version) == minor


@pytest.mark.parametrize("version, cls", [("0.16.1", v0_16.Adapter), ("0.17.1", v0_17.Adapter),
                                          ("0.18.2", v0_18.Adapter), ("0.19.2", v0_19.Adapter),
                                          ("0.19.0", v0_19.Adapter)])
def test_each_minor_gets_its_adapter(version, cls):
    assert type(adapters.adapter_for(version)) is cls


def test_the_adapter_files_are_the_supported_releases_and_setup_follows_the_newest():
    import os
    import re

    here = os.path.dirname(adapters.__file__)
    files = sorted(name for name in os.listdir(here) if re.fullmatch(r"v\d+_\d+\.py", name))
    assert [module.rsplit(".", 1)[1] + ".py" for module in adapters.ADAPTER_MODULES.values()] == files
    assert list(adapters.ADAPTER_MODULES) == sorted(adapters.ADAPTER_MODULES,
                                                    key=lambda v: tuple(map(int, v.split("."))))
    setup_py = os.path.join(here, "..", "..", "..", "setup.py")
    requirement = {}
    exec(open(setup_py).read().split("\nsetup(")[0], {"__file__": setup_py}, requirement)
    major, minor = map(int, list(adapters.ADAPTER_MODULES)[-1].split("."))
    assert requirement["megatron_core"] == f"megatron-core>=0.16.1,<{major}.{minor + 1}"


def test_unsupported_release_is_refused_unless_forced(monkeypatch):
    monkeypatch.delenv(adapters.FORCE_ENV, raising=False)
    for version in ("0.15.3", "0.20.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=f"but {version} is installed"):
            adapters.adapter_for(version)
    assert type(adapters.adapter_for("0.20.0", force=True)) is v0_19.Adapter
    monkeypatch.setenv(adapters.FORCE_ENV, "1")
    assert type(adapters.adapter_for("0.20.0")) is v0_19.Adapter


def test_every_adapter_implements_the_whole_interface():
    interface = {name for name, value in vars(base.MegatronAdapter).items()
                 if callable(value) and not name.startswith("__")}
    for minor in adapters.supported_minors():
        adapter = adapters.adapter_for(minor + ".0")
        assert adapter.minor == minor and adapter.tested_versions
        for name in interface:
            method = getattr(type(adapter), name)
            assert method is not getattr(base.MegatronAdapter, name) or name in (
                "cpu_training_sites", *base.LATER_RELEASE_ENTRY_POINTS), \
                f"{minor}: {name} missing"


def test_installed_release_is_a_tested_one_and_its_seams_exist():
    version = adapters.megatron_version().split("+")[0]
    assert version in adapters.tested_versions(), f"megatron-core {version} is not in the tested list"
    adapter = adapters.current_adapter()
    targets = adapter.patch_targets()
    for owner, name in base.SWAPPED_METHODS:
        assert name in vars(targets[owner]), f"{targets[owner].__name__}.{name} is gone"


def test_the_entry_points_of_later_releases_are_absent_where_the_adapter_says():
    """0.20's new entry points (issue 19 item 6) each have a place in the interface; the
    installed release's adapter says which of them it has, and megatron agrees."""
    import megatron.core.distributed.distributed_data_parallel as ddp_module
    import megatron.core.distributed.param_and_grad_buffer as buffer_module

    adapter = adapters.current_adapter()
    ddp = ddp_module.DistributedDataParallel
    assert adapter.param_ready_callback_class() is None
    assert not hasattr(ddp_module, "_BucketParamReadyCallback")
    assert adapter.finish_param_sync_site() is None
    assert not hasattr(ddp, "_finish_param_sync_for_bucket_group")
    assert adapter.traced_methods() == ()
    assert not hasattr(vars(ddp)["start_grad_sync"], "__wrapped__")
    assert not hasattr(vars(ddp)["finish_grad_sync"], "__wrapped__")
    assert not hasattr(buffer_module, "copy_tensors_to_quantized_params")
    site = adapter.quantized_param_copy()
    if site is None:
        assert not hasattr(buffer_module, "copy_tensor_to_quantized_param")
    else:
        owner, name = site
        assert callable(getattr(owner, name))


# --- each release's differences, on stand-ins ------------------------------------------

def _bucket_group(**ddp):
    ddp_config = SimpleNamespace(check_for_nan_in_grad=False, check_for_large_grads=False,
                                 overlap_param_gather=False, **ddp)
    param = SimpleNamespace(main_grad=torch.full((2,), 3.0), main_grad_copy_in_grad_buffer=torch.zeros(2))
    bucket = SimpleNamespace(grad_data=torch.ones(4), gradient_scaling_factor=0.5,
                             params_with_extra_main_grads=[param], params_list=[param])
    events = []
    group = SimpleNamespace(ddp_config=ddp_config, buckets=[bucket], grad_reduce_handle=None,
                            param_gather_handle=None, param_gather_dispatched=False,
                            previous_grad_reduce_bucket_group=None,
                            _post_param_sync=lambda: events.append("post"))
    return group, bucket, param, events


def test_0_16_scales_grads_only():
    group, bucket, param, _ = _bucket_group()
    v0_16.Adapter().before_grad_reduce(group)
    assert torch.equal(bucket.grad_data, torch.full((4,), 0.5))
    assert torch.equal(param.main_grad_copy_in_grad_buffer, torch.zeros(2))


def test_0_17_copies_extra_main_grads_into_the_buffer_first():
    group, bucket, param, _ = _bucket_group()
    v0_17.Adapter().before_grad_reduce(group)
    assert torch.equal(param.main_grad_copy_in_grad_buffer, torch.full((2,), 3.0))
    assert torch.equal(bucket.grad_data, torch.full((4,), 0.5))


def test_0_17_tolerates_buckets_without_param_buffer():
    group, bucket, _, _ = _bucket_group()
    assert v0_17.Adapter().param_buffers(group) == [None]


def test_0_18_runs_post_param_sync_where_megatron_does():
    adapter = v0_18.Adapter()
    group, _, _, events = _bucket_group()
    group.param_gather_handle = SimpleNamespace(wait=lambda: events.append("wait"))
    adapter.finish_pending_param_gather(group)
    assert events == ["wait", "post"] and group.param_gather_handle is None
    events.clear()
    adapter.set_param_gather_handle(group, None, force_sync=True)  # overlap off: DDP runs it
    assert events == [] and group.param_gather_dispatched
    group.ddp_config.overlap_param_gather = True
    adapter.set_param_gather_handle(group, None, force_sync=True)
    assert events == ["post"]
    assert v0_16.Adapter().finish_pending_param_gather is not None  # 0.16: no post step
    group.param_gather_handle = SimpleNamespace(wait=lambda: events.append("wait16"))
    events.clear()
    v0_16.Adapter().finish_pending_param_gather(group)
    assert events == ["wait16"]


def test_0_18_drains_the_previous_grad_reduce_first():
    group, _, _, _ = _bucket_group()
    drained = []
    group.previous_grad_reduce_bucket_group = SimpleNamespace(
        grad_reduce_handle=object(), finish_grad_sync=lambda: drained.append(True))
    v0_18.Adapter().before_grad_reduce(group)
    assert drained == [True]


def test_0_19_waits_for_cuda_graph_gradients_once_per_event(monkeypatch):
    group, bucket, param, _ = _bucket_group()
    event = object()
    param._cudagraph_wgrad_ready_event = event
    bucket.params_list = [param, param]
    waited = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a, **k: SimpleNamespace(wait_event=waited.append))
    v0_19.Adapter().before_grad_reduce(group)
    assert waited == [event]
    assert torch.equal(param.main_grad_copy_in_grad_buffer, torch.full((2,), 3.0))


def test_refusals_name_the_feature():
    config = SimpleNamespace(num_distributed_optimizer_instances=2, use_megatron_fsdp=False,
                             reduce_scatter_with_fp32_accumulation=True)
    found = v0_19.Adapter().unsupported_ddp_features(config)
    assert found == ["num_distributed_optimizer_instances > 1", "reduce_scatter_with_fp32_accumulation"]
