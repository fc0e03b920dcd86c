"""Megatron-LM's own training loop (``megatron.training.pretrain``) on CPU, with SDP4Bit.

A minimal pre-training script in the style of Megatron-LM's ``pretrain_gpt.py``
(GPTModel with the local layer spec, megatron-core's ``MockGPTDataset``, a
``forward_step``) is written to a temporary folder and started as a user would:

    SDP4BIT_CPU=1 torchrun --nproc-per-node 4 -m megatron_sdp4bit.launch script.py \
        <Megatron-LM args> --use-distributed-optimizer --sdp4bit ...

``SDP4BIT_CPU=1`` makes the launcher enable ``megatron_sdp4bit.cpu_backend``'s CPU training
(megatron-core's CPU backend plus the redirects ``megatron.training`` needs), so
``pretrain`` initializes, builds the model, DDP and the distributed optimizer,
the data loaders, and trains on gloo: 4 ranks, data-parallel 4 as 2 emulated
nodes x 2 (``--sdp4bit-ranks-per-node 2``), so TLq-HS runs both hops; then
tensor-parallel 2 x data-parallel 2. The checks:

- the layer is installed with the flags' config and really quantizes (the
  wire counters of both collectives are non-zero and below the exact bytes);
- the run-time replica check (``--sdp4bit-check-interval 1``) ran on every
  optimizer step (it raises, and the run fails, on any mismatch);
- the loss printed by Megatron-LM's ``training_log`` falls;
- after ``pretrain`` returns, every data-parallel replica holds bit-identical
  weights (SHA-256 of the whole model, per tensor-parallel rank).

Needs ``megatron.training`` (shipped in the megatron-core 0.19.2 wheel, not in
0.16.1's): skipped where it is not importable.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _megatron_training_importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


def _cpu_training_known() -> bool:
    """The adapter lists the CPU-training sites (0.19; 0.17/0.18 ship a loop whose API
    differs: ``pretrain`` parses its own arguments and this script's imports moved)."""
    from megatron_sdp4bit.megatron.adapters import current_adapter

    return current_adapter().cpu_training_sites() is not None


pytestmark = [
    pytest.mark.slow,  # 4 real processes each, most of the time importing megatron
    pytest.mark.skipif(
        not _megatron_training_importable(),
        reason="megatron.training (Megatron-LM's training loop) is not importable here; the "
               "megatron-core 0.19.2 wheel ships it: make test MCORE=0.19.2"),
    pytest.mark.skipif(
        _megatron_training_importable() and not _cpu_training_known(),
        reason="the CPU mode for megatron.training knows megatron-core 0.19's loop only "
               "(cpu_training_sites); make test MCORE=0.19.2"),
]

SCRIPT = textwrap.dedent('''
    """Minimal GPT pre-training with megatron.training.pretrain (like pretrain_gpt.py)."""
    import json
    import os
    from functools import partial

    import torch

    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import (
        GPTDatasetConfig, MockGPTDataset, MockGPTLowLevelDataset)
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args, pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import (
        core_transformer_config_from_args, parse_and_validate_args)

    import importlib

    import megatron.core.datasets.utils as datasets_utils
    import megatron.training
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training
    from megatron.core.rerun_state_machine import RerunStateMachine

    from megatron_sdp4bit import cpu_backend
    from megatron_sdp4bit.megatron import consistency, patch

    # What the CPU mode replaces, listed independently of cpu_backend/ and the adapter.
    SITES = [(megatron.training, "pretrain"), (training, "pretrain"),
             (megatron.training, "initialize_megatron"), (initialize, "initialize_megatron"),
             (training, "initialize_megatron"), (initialize, "_initialize_distributed"),
             (initialize, "_set_random_seed"), (initialize, "_warmup_jit_function"),
             (RerunStateMachine, "_save_state"),
             (RerunStateMachine, "_restore_state"), (arguments, "get_device_arch_version")]


    def site_values():
        return [getattr(owner, name) for owner, name in SITES]


    def all_megatron_originals():
        return all(getattr(value, "__module__", "").startswith("megatron.")
                   and not hasattr(value, "__wrapped_by_cpu_training__")
                   for value in site_values())


    ENABLED_BY_LAUNCHER = cpu_backend.is_cpu_training_enabled()  # SDP4BIT_CPU=1
    REPLACED = site_values()
    cpu_backend.enable_cpu_training()  # a second call changes nothing
    SECOND_ENABLE_IDEMPOTENT = site_values() == REPLACED and not all_megatron_originals()

    MODELS = []
    REPLICA_CHECKS = []
    _check_replicas = consistency.check_replicas


    def counting_check_replicas(*args, **kwargs):
        REPLICA_CHECKS.append(1)
        return _check_replicas(*args, **kwargs)


    consistency.check_replicas = counting_check_replicas


    class SmallMockCorpus(MockGPTLowLevelDataset):
        """megatron's mock documents (1, 2, 3, ..., EOD), fewer and shorter, so that
        building the sample indices takes milliseconds instead of seconds."""
        size = 2000
        max_sequence_length = 256


    class SmallMockGPTDataset(MockGPTDataset):
        @staticmethod
        def build_low_level_dataset(dataset_path, config):
            return SmallMockCorpus(config.tokenizer)


    def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                       pg_collection=None):
        args = get_args()
        model = GPTModel(
            config=core_transformer_config_from_args(args),
            transformer_layer_spec=get_gpt_layer_local_spec(
                num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            position_embedding_type=args.position_embedding_type,
        )
        MODELS.append(model)
        return model


    def datasets_provider(train_val_test_num_samples, vp_stage=None):
        args = get_args()
        config = GPTDatasetConfig(
            random_seed=args.seed, sequence_length=args.seq_length, blend=None,
            split="1,0,0", tokenizer=build_tokenizer(args), reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
            mid_level_dataset_surplus=0.005)
        return BlendedMegatronDatasetBuilder(
            SmallMockGPTDataset, train_val_test_num_samples,
            lambda: mpu.get_tensor_model_parallel_rank() == 0, config).build()


    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {
            "lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


    def forward_step(data_iterator, model):
        args = get_args()
        tp_rank = mpu.get_tensor_model_parallel_rank()
        batch = next(data_iterator) if tp_rank == 0 else None
        batch = get_batch_on_this_tp_rank(
            batch, has_cu_seqlens=False, is_hybrid_cp=False,
            create_attention_mask_in_dataloader=False,
            broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
            broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=1,
            tp_rank=tp_rank, micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length, mtp_on_this_rank=False)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(loss_func, batch["loss_mask"])


    if __name__ == "__main__":
        datasets_provider.is_distributed = True
        args = parse_and_validate_args()
        pretrain(pretrain_cfg_container_from_args(args), datasets_provider,
                 ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)

        config = patch.current_config()
        stats = patch.wire_stats()
        report = {
            "installed": patch.is_installed(), "weight_mode": config and config.weight_mode,
            # --log-params-norm reads the weights after the step: the layer drains first
            "params_norm_drains": hasattr(training.calc_params_l2_norm, "__wrapped__"),
            "grad_mode": config and config.grad_mode, "ranks_per_node": config and config.ranks_per_node,
            "iteration": patch.get_iteration(), "replica_checks": len(REPLICA_CHECKS),
            "wire": {c: [stats.sent_bytes(c), stats.exact_bytes(c)]
                     for c in ("all_gather", "reduce_scatter")},
            "tp": mpu.get_tensor_model_parallel_rank(), "dp": mpu.get_data_parallel_rank(),
            "ep": mpu.get_expert_model_parallel_rank(),
            "sha256": consistency.weights_sha256(MODELS[0]),
            "enabled_by_launcher": ENABLED_BY_LAUNCHER,
            "second_enable_idempotent": SECOND_ENABLE_IDEMPOTENT,
            "megatron_core": os.path.dirname(megatron.core.__file__),
            # (only tensor-parallel rank 0 builds datasets: the module this process would use)
            "helpers_cpp": importlib.import_module("megatron.core.datasets.helpers_cpp").__file__,
            "compile_helpers": datasets_utils.compile_helpers.__doc__,
        }
        cpu_backend.disable_cpu_training()
        report["restored"] = (all_megatron_originals() and not cpu_backend.is_cpu_backend_enabled()
                              and torch.cuda.current_device.__module__ == "torch.cuda")
        rank = torch.distributed.get_rank()
        with open(os.path.join(os.environ["REPORT_DIR"], f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
''')

ITERS = 10
MEGATRON_LM_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
    "--lr", "3e-3", "--lr-decay-style", "constant", "--seed", "1234",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
    "--transformer-impl", "local", "--bf16", "--use-distributed-optimizer",
    "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-rope-fusion", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--log-params-norm",
]  # no --distributed-backend: the CPU mode turns megatron's default, nccl, into gloo
SDP4BIT_ARGS = ["--sdp4bit", "--sdp4bit-ranks-per-node", "2", "--sdp4bit-check-interval", "1"]


def _launch(tmp_path, args, script_dir=None, nproc=4, extra_env=None):
    """``SDP4BIT_CPU=1 torchrun -m megatron_sdp4bit.launch SCRIPT args`` on ``nproc`` ranks,
    the script in ``script_dir`` (a checkout's root; ``tmp_path`` by default)."""
    script_dir = script_dir or tmp_path
    script = script_dir / "pretrain_tiny_gpt.py"
    script.write_text(SCRIPT)
    reports = tmp_path / "reports"
    reports.mkdir(exist_ok=True)
    # CUDA_DEVICE_MAX_CONNECTIONS: validate_args demands it for TP on a pre-Blackwell
    # device, which is what the CPU reports (cpu_backend/megatron_training.py, site 6).
    env = dict(os.environ, SDP4BIT_CPU="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               CUDA_DEVICE_MAX_CONNECTIONS="1", REPORT_DIR=str(reports),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **(extra_env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.1",
           "-m", "megatron_sdp4bit.launch", str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))


def _train(tmp_path, extra_args, script_dir=None, extra_env=None):
    """Run the script on 4 ranks; Megatron-LM's logged losses and each rank's report."""
    result = _launch(tmp_path, [*MEGATRON_LM_ARGS, *extra_args, *SDP4BIT_ARGS], script_dir,
                     extra_env=extra_env)
    output = result.stdout + result.stderr
    if result.returncode != 0:  # the failing ranks' tracebacks, not torchrun's summary
        failed = [line for line in output.splitlines() if re.match(r"\[rank\d\]:", line)]
        if failed:
            pytest.fail("training failed:\n" + "\n".join(failed[-60:]))
        first = output.find("Traceback")  # a rank that failed before torch.distributed
        pytest.fail("training failed:\n" + output[max(first, 0):][:6000])
    # training_log (printed by the last rank only): one line per iteration.
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.Ee+-]+) \|", output)]
    return losses, [json.loads((tmp_path / "reports" / f"rank{r}.json").read_text()) for r in range(4)]


def _check_run(losses, reports, tp_size, sub_optimizers=1, ranks_per_node=2):
    # Megatron-LM's training_log printed one loss per iteration, and it fell.
    assert len(losses) == ITERS, losses
    assert losses[-1] < 0.9 * losses[0], losses

    for rank, report in enumerate(reports):
        # Installed from the flags on every rank, stepped every iteration, and the
        # replicas were checked at every step (a mismatch would have failed the run).
        assert report["installed"], rank
        assert (report["weight_mode"], report["grad_mode"], report["ranks_per_node"]) == \
            ("diff", "tlq-hs", ranks_per_node), report
        # (MoE: megatron chains a dense and an expert optimizer; each checks its own
        # buffers, and the chain's step counts one iteration.)
        assert report["iteration"] == ITERS, report
        assert report["replica_checks"] == ITERS * sub_optimizers, report
        # The launcher enabled the CPU mode; enabling again changed nothing; disabling
        # put megatron's own functions and torch.cuda back.
        assert report["enabled_by_launcher"] and report["second_enable_idempotent"], report
        assert report["restored"], report
        assert report["params_norm_drains"], report
        # Both collectives went through the quantized path, with fewer bytes than exact.
        for collective, (sent, exact) in report["wire"].items():
            assert 0 < sent < exact, (rank, collective, sent, exact)

    # Data-parallel replicas are bit-identical; tensor-parallel ranks (and expert-parallel
    # ranks: other experts) hold other shards.
    by_shard = {}
    for report in reports:
        by_shard.setdefault((report["tp"], report["ep"]), {})[report["dp"]] = report["sha256"]
    assert sorted(tp for tp, _ in by_shard) == sorted(list(range(tp_size)) * (len(by_shard) // tp_size))
    for shard, replicas in by_shard.items():
        assert len(replicas) == 4 // len(by_shard), by_shard
        assert len(set(replicas.values())) == 1, (shard, replicas)
    if len(by_shard) > 1:
        assert len({next(iter(r.values())) for r in by_shard.values()}) == len(by_shard), by_shard


def _bytes_ratio(report):
    """Bytes sent over the exact bytes, both collectives together."""
    sent, exact = (sum(pair[i] for pair in report["wire"].values()) for i in (0, 1))
    return sent / exact


@pytest.fixture(scope="module")
def dense_dp4(tmp_path_factory):
    """The dense data-parallel-4 run (2 emulated nodes x 2), shared by the tests below."""
    return _train(tmp_path_factory.mktemp("dense"), [])


def test_pretrain_dp4_two_emulated_nodes(dense_dp4):
    losses, reports = dense_dp4
    _check_run(losses, reports, tp_size=1)


MOE_ARGS = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2"]


@pytest.mark.parametrize("overlap_param_gather", [False, True], ids=["gather-at-step", "overlapped"])
def test_pretrain_moe_expert_dp_across_emulated_nodes(tmp_path, dense_dp4, overlap_param_gather):
    """MoE: expert-parallel 2, so each expert-data-parallel group ({0, 2}, {1, 3}) spans
    both emulated nodes; megatron chains a dense and an expert distributed optimizer.
    Without --overlap-param-gather each of them synced every bucket group of the model
    (megatron-core's step_with_ready_grads): the other's groups went exact, twice, and
    the bytes ratio was 0.406 against the dense run's 0.244. Each group is now sent once,
    by its own optimizer, quantized. With both of Megatron's overlap flags (as users
    train) the expert groups' gathers run in the forward pre-hooks: 0.208 measured."""
    args = [a for a in MEGATRON_LM_ARGS if overlap_param_gather or a != "--overlap-param-gather"]
    result = _launch(tmp_path, [*args, *MOE_ARGS, *SDP4BIT_ARGS])
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    output = result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.Ee+-]+) \|", output)]
    reports = [json.loads((tmp_path / "reports" / f"rank{r}.json").read_text()) for r in range(4)]
    _check_run(losses, reports, tp_size=1, sub_optimizers=2)
    # rank 0 says what the layer planned: 2 nodes emulated on the one host, both hops
    # for the dense group, the expert-DP group (one rank per node) across the nodes
    assert "sdp4bit nodes: 1 host x 4 ranks (from the hosts), planned as 2 nodes of 2" in output
    assert ("sdp4bit gradient hops, DP 4: 8-bit inside a node (2 ranks), "
            "then 4-bit across nodes (2 ranks)") in output
    assert "sdp4bit gradient hops, expert DP 2: 4-bit across nodes (2 ranks)" in output
    assert ("sdp4bit weight gather, DP 4: 4-bit across nodes (2 ranks), "
            "then inside a node (2 ranks)") in output
    # the overlapped collectives' waits on the iteration line (the gradients are always
    # overlapped here; the weights with --overlap-param-gather)
    gathers = r" \+ AG \d+" if overlap_param_gather else ""
    assert re.search(rf"sdp4bit waited RS \d+{gathers} ms/iter \|", output), output[-3000:]
    dense = _bytes_ratio(dense_dp4[1][0])
    for report in reports:
        assert abs(_bytes_ratio(report) - dense) < 0.05, (_bytes_ratio(report), dense)


def test_pretrain_moe_expert_dp_inside_one_node(tmp_path):
    """MoE on one node of 4 ranks (``--sdp4bit-ranks-per-node 4``): the expert-DP groups
    {0, 2} and {1, 3} sit inside the node, so their collectives take the one-level
    (8-bit) path; the dense groups likewise. Replicas bit-identical every step."""
    args = [a for a in MEGATRON_LM_ARGS if a != "--overlap-param-gather"]
    one_node = ["--sdp4bit", "--sdp4bit-ranks-per-node", "4", "--sdp4bit-check-interval", "1"]
    result = _launch(tmp_path, [*args, *MOE_ARGS, *one_node])
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    output = result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.Ee+-]+) \|", output)]
    reports = [json.loads((tmp_path / "reports" / f"rank{r}.json").read_text()) for r in range(4)]
    _check_run(losses, reports, tp_size=1, sub_optimizers=2, ranks_per_node=4)
    # one 8-bit level for the gradients (1/4 of fp32, plus scales) and 4-bit weight
    # differences (1/4 of bf16, plus scales): 0.27 measured, against 0.208 on two levels
    for report in reports:
        assert 0.2 < _bytes_ratio(report) < 0.3, _bytes_ratio(report)


def test_pretrain_moe_8_ranks_expert_dp_on_both_levels(tmp_path):
    """8 ranks as 2 emulated nodes x 4, expert-parallel 2: each expert-DP group
    ({0, 2, 4, 6}, {1, 3, 5, 7}) has 2 members on each node, so the expert buckets run
    both hops on groups of their own, beside the dense DP-8 groups (4 per node)."""
    args = [a for a in MEGATRON_LM_ARGS if a != "--overlap-param-gather"]
    args[args.index("--global-batch-size") + 1] = "16"  # micro-batch 2 x DP 8
    flags = ["--sdp4bit", "--sdp4bit-ranks-per-node", "4", "--sdp4bit-check-interval", "1"]
    result = _launch(tmp_path, [*args, *MOE_ARGS, *flags], nproc=8)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    output = result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.Ee+-]+) \|", output)]
    assert len(losses) == ITERS and losses[-1] < 0.9 * losses[0], losses
    assert ("sdp4bit gradient hops, expert DP 4: 8-bit inside a node (2 ranks), "
            "then 4-bit across nodes (2 ranks)") in output
    reports = [json.loads((tmp_path / "reports" / f"rank{r}.json").read_text()) for r in range(8)]
    by_expert_rank = {}
    for report in reports:
        assert report["iteration"] == ITERS and report["replica_checks"] == 2 * ITERS, report
        by_expert_rank.setdefault(report["ep"], set()).add(report["sha256"])
        # two levels over 4 members per node for the dense groups, 2 for the experts':
        # 0.263 measured (a share of the gradients stays 8-bit inside the nodes)
        assert 0.2 < _bytes_ratio(report) < 0.3, _bytes_ratio(report)
    # the replicas of each expert-parallel rank agree; the two hold other experts
    assert sorted(by_expert_rank) == [0, 1] and all(len(s) == 1 for s in by_expert_rank.values())
    assert by_expert_rank[0] != by_expert_rank[1]


def test_pretrain_tp2_dp2(tmp_path):
    losses, reports = _train(tmp_path, ["--tensor-model-parallel-size", "2"])
    _check_run(losses, reports, tp_size=2)



# ---------------------------------------------------------------- a fresh checkout

# Megatron-LM's dataset folder builds helpers_cpp with this Makefile's interface: what the
# python3 first on PATH says about pybind11's headers and the extension suffix.
CHECKOUT_MAKEFILE = """\
CXXFLAGS += -O3 -Wall -shared -std=c++17 -fPIC
CPPFLAGS += $(shell python3 -m pybind11 --includes)
LIBEXT = $(shell python3-config --extension-suffix)

helpers_cpp$(LIBEXT): helpers.cpp
\t$(CXX) $(CXXFLAGS) $(CPPFLAGS) $< -o $@
"""


def _fresh_checkout(tmp_path, edit_helpers=False):
    """A Megatron-LM checkout as a fresh clone has it, made from what the machine has: the
    installed wheel's ``megatron/`` (core and training) without its compiled helpers, with a
    Makefile beside ``helpers.cpp``. ``edit_helpers``: a ``helpers.cpp`` that is not the
    installed one's (so that build cannot stand in)."""
    import megatron.core

    tree = tmp_path / "Megatron-LM"
    shutil.copytree(os.path.dirname(os.path.dirname(megatron.core.__file__)), tree / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "helpers_cpp*"))
    datasets = tree / "megatron" / "core" / "datasets"
    (datasets / "Makefile").write_text(CHECKOUT_MAKEFILE)
    if edit_helpers:
        with open(datasets / "helpers.cpp", "a") as source:
            source.write("\n// edited in this checkout\n")
    return tree


def _pybind11_here() -> bool:
    return importlib.util.find_spec("pybind11") is not None and shutil.which("g++") is not None


def test_a_fresh_checkout_trains_with_the_installed_helpers(tmp_path):
    """Before: ``make`` in the checkout with the python3 on PATH ("fatal error:
    pybind11/pybind11.h", then gloo's "Connection closed by peer" on every other rank).
    Now the installed megatron-core's build of the same helpers.cpp is used; nothing is
    compiled, and the checkout's megatron is the one that trains."""
    tree = _fresh_checkout(tmp_path)
    losses, reports = _train(tmp_path, [], script_dir=tree)
    _check_run(losses, reports, tp_size=1)
    datasets = tree / "megatron" / "core" / "datasets"
    import megatron.core

    for report in reports:
        assert report["megatron_core"] == str(tree / "megatron" / "core"), report
        assert os.path.dirname(report["helpers_cpp"]) == os.path.join(
            os.path.dirname(megatron.core.__file__), "datasets"), report
        assert "(prebuilt)" in report["compile_helpers"], report
    assert not [name for name in os.listdir(datasets) if name.startswith("helpers_cpp")]


def _refused_line(result):
    """The job's refusal: exactly one line starting 'error: ', from one rank, exit code 2,
    before Megatron-LM initialized or trained anything."""
    output = result.stdout + result.stderr
    ours = [line for line in output.splitlines() if "error: " in line and "exitcode" not in line
            and "ChildFailedError" not in line]
    assert result.returncode != 0 and len(ours) == 1, output[-4000:]
    assert "exitcode  : 2" in output, output[-4000:]
    # The one traceback is torchrun's own report; nothing of megatron ran.
    assert output.count("Traceback") <= 1 and "megatron_sdp4bit/" not in output, output[-4000:]
    assert "initializing torch distributed" not in output and "iteration" not in output, output[-4000:]
    return ours[0]


@pytest.mark.skipif(_pybind11_here(), reason="pybind11 is installed: these helpers would be compiled")
def test_a_fresh_checkout_that_cannot_build_its_helpers_is_refused_in_one_line(tmp_path):
    tree = _fresh_checkout(tmp_path, edit_helpers=True)
    line = _refused_line(_launch(tmp_path, [*MEGATRON_LM_ARGS, *SDP4BIT_ARGS], tree, nproc=2))
    assert line.startswith("error: Megatron-LM builds its dataset helpers"), line
    assert f"pybind11 ({sys.executable} -m pip install pybind11)" in line, line


@pytest.mark.skipif(not _pybind11_here(), reason="pybind11 (pip install pybind11) and g++ are needed to "
                                                 "compile the dataset helpers")
def test_a_fresh_checkout_compiles_its_helpers_for_this_python(tmp_path):
    """The checkout's Makefile, run with this Python's pybind11 headers and extension suffix
    whatever python3 is first on PATH."""
    tree = _fresh_checkout(tmp_path, edit_helpers=True)
    losses, reports = _train(tmp_path, [], script_dir=tree)
    _check_run(losses, reports, tp_size=1)
    import sysconfig

    built = tree / "megatron" / "core" / "datasets" / ("helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    assert built.is_file()
    assert all(report["helpers_cpp"] == str(built) for report in reports), reports
