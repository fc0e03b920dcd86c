"""The patch layer on megatron-core's real DDP + distributed optimizer, 4 gloo ranks.

4 ranks emulate 2 nodes x 2 ranks (ranks_per_node=2), so TLq-HS runs both hops.
Each world trains several configurations one after another (spawning costs more
than training these tiny models), and every test reads the shared results.

Tolerance for "SDP4Bit tracks the baseline": the tiny GPT's loss after 20 steps
must be within 5% of the exact run's (4-bit weight differences and 8/4-bit
gradients add noise of a few per cent of a step's update, far below that) and
below 85% of the initial loss (the model learns).
"""
from __future__ import annotations

import pytest

from megatron_sdp4bit.config import preset
from harness import spawn_ranks
from harness.tiny_gpt import TinyGPTSpec, refusal

WORLD = 4
STEPS = 20
RANKS_PER_NODE = 2
LOSS_TOLERANCE = 0.05


def _train(spec: TinyGPTSpec, config, steps: int):
    from megatron_sdp4bit import comm
    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit.megatron import patch

    patch.uninstall()
    comm.reset_generators()
    layer = patch.install(config) if config is not None else None
    trainer = TinyGPTTrainer(spec)
    records = trainer.train_steps(steps)
    memory = None
    if config is not None:
        # What the layer really holds after training vs what it reports at start-up.
        held = sum(t.numel() * t.element_size() for bucket in layer.state.buckets.values()
                   for t in (bucket.main_shard, bucket.reconstructed) if t is not None)
        params = sum(p.numel() for p in trainer.model.parameters())
        reported = patch.memory(trainer.optimizer, params)
        memory = (held, reported.held_bytes, layer.state.buffer_bytes(), reported.buffer_bytes)
        # The rounding streams are the layer's own (checkpointed with it), not comm's defaults.
        streams = sorted({key[3] for key in layer.state.rounding_streams.states()})
        default_streams = sorted({key[3] for key in comm.generator_states()})
    patch.uninstall()
    return {
        "losses": [r.loss for r in records],
        "hashes": [r.weights_sha256 for r in records],
        "buckets": trainer.num_buckets,
        "memory": memory,
        "streams": (streams, default_streams) if config is not None else None,
    }


def _world(rank, world_size, cases):
    return [_train(spec, config, steps) for spec, config, steps in cases]


SDP = preset("sdp4bit", ranks_per_node=RANKS_PER_NODE)
BASE_SPEC = TinyGPTSpec(dtype="bf16", lr=3e-3)
MATRIX = {
    "bf16": TinyGPTSpec(dtype="bf16"),
    "fp32": TinyGPTSpec(dtype="fp32"),
    "bf16-overlap-grad": TinyGPTSpec(dtype="bf16", overlap_grad_reduce=True, bucket_size=4000),
    "bf16-overlap-both": TinyGPTSpec(dtype="bf16", overlap_grad_reduce=True,
                                     overlap_param_gather=True, bucket_size=4000),
    "fp32-overlap-both": TinyGPTSpec(dtype="fp32", overlap_grad_reduce=True,
                                     overlap_param_gather=True, bucket_size=4000,
                                     grad_reduce_in_fp32=True),
}


@pytest.fixture(scope="module")
def exactness_runs():
    """Stock megatron vs the layer installed with quantization off / gradients from step 3."""
    cases = [
        (BASE_SPEC, None, 6),
        (BASE_SPEC, preset("baseline", ranks_per_node=RANKS_PER_NODE), 6),
        (BASE_SPEC, preset("tlq-hs-only", ranks_per_node=RANKS_PER_NODE, grad_start_iter=3), 6),
    ]
    return spawn_ranks(_world, WORLD, cases, timeout_s=600)


@pytest.fixture(scope="module")
def matrix_runs():
    cases = []
    for spec in MATRIX.values():
        cases += [(spec, None, STEPS), (spec, SDP, STEPS)]
    return spawn_ranks(_world, WORLD, cases, timeout_s=900)


def _by_name(per_rank):
    names = list(MATRIX)
    out = {}
    for i, name in enumerate(names):
        out[name] = ([r[2 * i] for r in per_rank], [r[2 * i + 1] for r in per_rank])
    return out


def test_quantization_off_is_bit_identical_to_stock(exactness_runs):
    stock = exactness_runs[0][0]
    patched = exactness_runs[0][1]
    assert patched["losses"] == stock["losses"]
    assert patched["hashes"] == stock["hashes"]


def test_grad_start_iter_keeps_exact_steps_until_k(exactness_runs):
    stock = exactness_runs[0][0]
    delayed = exactness_runs[0][2]
    assert delayed["hashes"][:3] == stock["hashes"][:3]
    assert delayed["hashes"][3] != stock["hashes"][3]


@pytest.mark.parametrize("name", list(MATRIX))
def test_ranks_hold_bit_identical_weights_after_every_step(matrix_runs, name):
    _stock, sdp = _by_name(matrix_runs)[name]
    for step in range(STEPS):
        assert len({rank["hashes"][step] for rank in sdp}) == 1, f"{name}: ranks differ at step {step}"


@pytest.mark.parametrize("name", list(MATRIX))
def test_sdp4bit_loss_tracks_the_baseline_and_decreases(matrix_runs, name):
    stock, sdp = _by_name(matrix_runs)[name]
    base_loss = sum(r["losses"][-1] for r in stock) / WORLD
    sdp_loss = sum(r["losses"][-1] for r in sdp) / WORLD
    first = sum(r["losses"][0] for r in sdp) / WORLD
    assert sdp_loss < 0.85 * first, f"{name}: no learning ({first:.3f} -> {sdp_loss:.3f})"
    assert abs(sdp_loss - base_loss) <= LOSS_TOLERANCE * base_loss, (
        f"{name}: SDP4Bit {sdp_loss:.4f} vs exact {base_loss:.4f}")
    # The quantized run must really differ from the exact one (the layer is in the path).
    assert sdp[0]["hashes"] != stock[0]["hashes"]


@pytest.mark.parametrize("name", list(MATRIX))
def test_reported_held_memory_is_what_the_layer_holds(matrix_runs, name):
    """The held bytes the driver prints at start-up (patch.memory) equal the fp32 main
    shards (and, for fp32 params, set-aside reconstructions) the layer really keeps, and
    its reused send/receive buffers what the collectives' workspaces hold after training."""
    _stock, sdp = _by_name(matrix_runs)[name]
    for rank in sdp:
        actual, reported, buffers, reported_buffers = rank["memory"]
        assert actual == reported > 0, f"{name}: holds {actual} bytes, reports {reported}"
        assert buffers == reported_buffers > 0, (
            f"{name}: its reused buffers hold {buffers} bytes, it reports {reported_buffers}")


def test_the_layer_draws_its_rounding_noise_from_its_own_streams(matrix_runs):
    _stock, sdp = _by_name(matrix_runs)["bf16"]
    for rank in sdp:
        streams, default_streams = rank["streams"]
        # one stream per purpose and bucket group (state.name_streams), none of comm's
        assert {s.split("/")[0] for s in streams} == {"grads", "weights"}, streams
        assert all(s.split("/")[1].startswith("bucket group ") for s in streams), streams
        assert default_streams == []


def test_several_buckets_were_exercised(matrix_runs):
    stock, _sdp = _by_name(matrix_runs)["bf16-overlap-grad"]
    assert stock[0]["buckets"] > 1


# --- install / uninstall and bad configurations ---------------------------------------

def test_install_twice_and_uninstall_restore_megatron():
    from megatron_sdp4bit.megatron import compat, patch

    classes = list(compat.current_adapter().patch_targets().values())
    before = [dict(vars(cls)) for cls in classes]
    first = patch.install(SDP)
    assert patch.install(SDP.replace(seed=5)) is first  # a second install replaces the config only
    assert patch.current_config().seed == 5
    bucket_group_cls = classes[0]
    assert bucket_group_cls.start_grad_sync is not before[0]["start_grad_sync"]
    first.state.wire.add("reduce_scatter", "intra", codes=10, exact=40)
    patch.uninstall()
    patch.uninstall()  # safe when not installed
    after = [dict(vars(cls)) for cls in classes]
    for b, a in zip(before, after):
        for key in ("start_grad_sync", "start_param_sync", "_copy_main_params_to_model_params",
                    "step_with_ready_grads", "__init__"):
            if key in b:
                assert a[key] is b[key]
    # after uninstall the facade says plainly that nothing is installed
    assert not patch.is_installed() and patch.current_config() is None and patch.adapter_minor() is None
    assert patch.wire_stats().sent_bytes() == 0 and patch.get_iteration() == 0
    for needs_a_layer in (lambda: patch.set_metrics_interval(1), lambda: patch.optimizer_group(None)):
        with pytest.raises(RuntimeError, match=r"needs the SDP4Bit layer installed: call .*patch.install"):
            needs_a_layer()
    # a reinstall is a fresh layer: its own counters, from zero
    second = patch.install(SDP)
    assert second is not first and patch.is_installed() and patch.wire_stats().sent_bytes() == 0
    assert patch.adapter_minor() == compat.current_adapter().minor
    patch.uninstall()


def test_install_rejects_non_config():
    from megatron_sdp4bit.megatron import patch

    with pytest.raises(TypeError, match="SDP4BitConfig"):
        patch.install({"weight_mode": "diff"})


def _mismatch(rank, world_size):
    return refusal(SDP.replace(seed=rank))


def test_mismatched_configs_raise_on_every_rank():
    messages = spawn_ranks(_mismatch, 2, timeout_s=120)
    assert all(m is not None and "differs across ranks" in m for m in messages)


def _no_distributed_optimizer(rank, world_size):
    return refusal(SDP, TinyGPTSpec(use_distributed_optimizer=False))


def _plain_ddp_with_quantization_off(rank, world_size):
    """Without the distributed optimizer megatron all-reduces: the layer, installed with
    quantization off (as the driver always installs it), leaves that to megatron."""
    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit.megatron import patch

    spec = TinyGPTSpec(dtype="fp32", use_distributed_optimizer=False)
    stock = [r.weights_sha256 for r in TinyGPTTrainer(spec).train_steps(3)]
    patch.install(preset("baseline", ranks_per_node=RANKS_PER_NODE))
    try:
        patched = [r.weights_sha256 for r in TinyGPTTrainer(spec).train_steps(3)]
    finally:
        patch.uninstall()
    return stock, patched


def test_plain_ddp_with_quantization_off_is_megatrons_own():
    for stock, patched in spawn_ranks(_plain_ddp_with_quantization_off, 2, timeout_s=180):
        assert patched == stock


def test_plain_ddp_is_refused_with_a_clear_error():
    messages = spawn_ranks(_no_distributed_optimizer, 2, timeout_s=120)
    assert all(m is not None and "--use-distributed-optimizer" in m for m in messages)


def test_unsupported_megatron_version_is_refused(monkeypatch):
    from megatron_sdp4bit.megatron import compat

    monkeypatch.setattr(compat, "megatron_version", lambda: "0.99.0")
    monkeypatch.delenv(compat.FORCE_ENV, raising=False)
    from megatron_sdp4bit.megatron.adapters import supported_minors

    with pytest.raises(RuntimeError, match=f"supports megatron-core {', '.join(supported_minors())}"):
        compat.check_version()
    assert compat.check_version(force=True) == "0.99.0"


def _resume_without_weight_quantization(rank, world_size):
    """fp32 params, qWD for 3 steps, its layer state saved; then the same model resumed
    with the exact collectives: the weights must be the exact main weights, not the
    shared reconstruction (which is what megatron's own state holds with fp32 params)."""
    import torch

    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit.megatron import patch

    patch.uninstall()
    layer = patch.install(SDP.replace(ranks_per_node=1))
    trainer = TinyGPTTrainer(TinyGPTSpec(dtype="fp32"))
    trainer.train_steps(3)
    saved = patch.state_dict(trainer.optimizer)
    keyed = [((index, *key), bucket) for index, opt in enumerate(layer.adapter.sub_optimizers(trainer.optimizer))
             for key, bucket in layer.adapter.buffer_buckets(opt)]
    before = [layer.adapter.bucket_param_data(b).clone() for _, b in keyed]
    patch.uninstall()
    layer = patch.install(preset("baseline"))
    patch.load_state_dict(saved, trainer.optimizer)
    result = []
    for (key, bucket), old in zip(keyed, before):
        params = layer.adapter.bucket_param_data(bucket)
        mains = [torch.empty_like(saved["main_shards"][key]) for _ in range(world_size)]
        torch.distributed.all_gather(mains, saved["main_shards"][key])
        result.append({"exact": torch.equal(params, torch.cat(mains)),
                       "was_reconstructed": not torch.equal(old, torch.cat(mains))})
    patch.uninstall()
    return result


def test_a_qwd_checkpoint_resumed_without_weight_quantization_continues_from_exact_weights():
    for rank_result in spawn_ranks(_resume_without_weight_quantization, 2, timeout_s=300):
        assert rank_result and all(b == {"exact": True, "was_reconstructed": True} for b in rank_result)
