"""The trainer and the transformers policy on a CUDA GPU (`gpu` tests: they skip where there is none).

Run where the project is installed without network (../shared/gpu/README.md):
`PYTHONPATH=/tmp/site python3 -P -m pytest -m "gpu and not vllm" tests -x -q`. None of these needs
vLLM or Docker, except the two at the end, which also need vLLM's CUDA build (`-m "gpu and vllm"`).

Tolerances in bf16: 8 mantissa bits give a relative rounding of 2^-9 per operation, so a log-prob
of about -8 nats computed through a few layers in bf16 is expected within a few hundredths of the
fp32 value; the checks below say which comparison each bound is for.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.batch import collate, sequence_logprobs
from agentrl.train.config import TrainConfig
from agentrl.train.logprobs import action_logprobs
from tests.fixtures_dist import assert_same_gradients, one_rank_group  # noqa: F401
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def batch_of(vocab: int, n: int = 8, seed: int = 0, lo: int = 40, hi: int = 300) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(lo, hi)
        mask = [0] * 16 + [1 if (j // 24) % 2 == 0 else 0 for j in range(length - 16)]
        out.append(
            Trajectory(
                task_id=f"t{i}",
                group_id=f"g{i // 4}",
                token_ids=[rng.randrange(vocab) for _ in range(length)],
                loss_mask=mask,
                behavior_logprobs=[-7.8 if m else 0.0 for m in mask],
                prompt_len=16,
                reward=float(i % 2),
                passed=bool(i % 2),
                finish_reason="submitted",
                policy_version=0,
            )
        )
    return out


def load(model_dir: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(CUDA)
    model.config._attn_implementation = "sdpa"
    return model


def step(model_dir: Path, info, trajs, **optim):
    """One grpo_step on CUDA (FSDP2 on NCCL, bf16 compute with fp32 master weights); (grads, metrics)."""
    from tests.fixtures_dist import grpo_step_gradients

    cfg = TrainConfig(model=str(model_dir), optim={"grad_clip": 1e9, "bf16": True, **optim})
    return grpo_step_gradients(model_dir, info, cfg, trajs)


def test_varlen_kernel_matches_causal_attention_per_sequence() -> None:
    from agentrl.train.varlen import _flash_varlen, _reference_varlen, kernel_available

    assert kernel_available(CUDA, torch.bfloat16), "torch's varlen flash attention should run on this GPU"
    torch.manual_seed(0)
    lengths = [512, 1536, 7, 900]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    n = sum(lengths)
    q = torch.randn(n, 12, 128, device=CUDA, dtype=torch.bfloat16)
    k = torch.randn(n, 2, 128, device=CUDA, dtype=torch.bfloat16)  # GQA, as Qwen2.5-1.5B
    v = torch.randn(n, 2, 128, device=CUDA, dtype=torch.bfloat16)
    fast = _flash_varlen(q, k, v, cu, max(lengths), 128**-0.5)
    ref = _reference_varlen(q.float(), k.float(), v.float(), cu, 128**-0.5)
    # Attention outputs are averages of values of size ~1: bf16 rounding leaves ~1e-2 at most.
    assert (fast.float() - ref).abs().max().item() < 2e-2


def test_packed_and_padded_logprobs_agree_in_bf16(tiny_model_dir) -> None:  # noqa: F811
    model = load(tiny_model_dir, torch.bfloat16)
    batch = collate(batch_of(model.config.vocab_size), pad_id=0).to(CUDA)
    with torch.no_grad():
        padded = action_logprobs(model, batch, packed=False).logprobs
        packed = action_logprobs(model, batch, packed=True).logprobs  # the varlen kernel
    mask = batch.loss_mask.bool()
    # Two bf16 attention kernels over the same inputs: differences of bf16 rounding only.
    assert (padded - packed)[mask].abs().max().item() < 0.05
    assert (padded - packed)[mask].abs().mean().item() < 5e-3


def test_bf16_logprobs_are_as_accurate_as_bf16_logits_against_fp32(tiny_model_dir) -> None:  # noqa: F811
    fp32 = load(tiny_model_dir)
    bf16 = load(tiny_model_dir, torch.bfloat16)
    batch = collate(batch_of(fp32.config.vocab_size), pad_id=0).to(CUDA)
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        exact = sequence_logprobs(
            fp32(batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
        )
        lean = action_logprobs(bf16, batch, packed=False).logprobs  # the same attention as `usual`
        usual = sequence_logprobs(
            bf16(batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
        )  # bf16 logits, fp32 log-softmax: what a plain trainer computes
    err_lean = (lean - exact)[mask].abs()
    err_usual = (usual - exact)[mask].abs()
    assert err_lean.mean().item() < 0.05 and err_lean.max().item() < 0.5
    # Same backbone, same attention: only the head differs, and ours writes fp32 logits: never worse
    # than rounding them to bf16 first.
    assert err_lean.mean().item() <= err_usual.mean().item() * 1.05 + 1e-4


def test_training_step_on_the_gpu_packed_and_padded(tiny_model_dir, one_rank_group) -> None:  # noqa: F811
    assert one_rank_group.device.type == "cuda" and one_rank_group.backend == "nccl"
    trajs = batch_of(2543)
    packed, m_packed = step(
        tiny_model_dir, one_rank_group, trajs, packing="on", max_tokens_per_micro_batch=1024
    )
    padded, m_padded = step(
        tiny_model_dir, one_rank_group, trajs, packing="off", max_tokens_per_micro_batch=1024
    )
    for m in (m_packed, m_padded):
        assert torch.isfinite(torch.tensor(m["losses/policy_loss"])) and m["losses/grad_norm"] > 0
        assert m["batch/action_tokens"] == sum(sum(t.loss_mask) for t in trajs)
    assert m_packed["losses/policy_loss"] == pytest.approx(m_padded["losses/policy_loss"], rel=2e-2, abs=1e-4)
    # Two bf16 attention kernels (varlen flash, masked sdpa): rounding differences, not O(1) ones.
    assert_same_gradients(padded, packed, rel=0.1)


def test_activation_checkpointing_on_the_gpu_gives_the_same_gradients(tiny_model_dir, one_rank_group) -> None:  # noqa: F811
    trajs = batch_of(2543)
    off, m_off = step(tiny_model_dir, one_rank_group, trajs, activation_checkpointing=False)
    on, m_on = step(tiny_model_dir, one_rank_group, trajs, activation_checkpointing=True)
    assert m_on["losses/policy_loss"] == pytest.approx(m_off["losses/policy_loss"], rel=1e-3, abs=1e-5)
    # The recomputed forward runs the same kernels on the same inputs; flash attention's backward
    # accumulates in a run-dependent order, hence not bitwise.
    assert_same_gradients(off, on, rel=2e-2)


def test_transformers_policy_samples_on_the_gpu(tiny_model_dir) -> None:  # noqa: F811
    from agentrl.rollout.policy import HFPolicy, SamplingConfig
    from tests.rollout.score import score_logprobs

    gpu = HFPolicy(tiny_model_dir)  # a directory loads onto CUDA when there is one
    cpu = HFPolicy(tiny_model_dir, device="cpu")
    assert next(gpu.model.parameters()).device.type == "cuda"
    prompt = [5, 6, 7, 8, 9, 10]
    greedy = SamplingConfig(temperature=0.0, max_tokens=8)
    a, b = gpu.generate_sync(prompt, greedy), cpu.generate_sync(prompt, greedy)
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3
    seeded = SamplingConfig(temperature=1.0, max_tokens=8, seed=3)
    assert gpu.generate_sync(prompt, seeded).token_ids == gpu.generate_sync(prompt, seeded).token_ids
    scored = score_logprobs(gpu.model, prompt + a.token_ids)[len(prompt) :]
    assert max(abs(x - y) for x, y in zip(scored, a.logprobs, strict=True)) < 1e-3


def test_defaults_fit_8k_token_trajectories(tiny_model_dir, one_rank_group) -> None:  # noqa: F811
    """The defaults with 8,192-token trajectories: one sequence per micro-batch, no out-of-memory."""
    trajs = batch_of(2543, n=2, lo=8192, hi=8192)
    _, m = step(tiny_model_dir, one_rank_group, trajs)
    assert m["batch/action_tokens"] == sum(sum(t.loss_mask) for t in trajs)


# --- shared prefixes through the varlen kernel, compiled decoder layers -----------------------------------


def grpo_groups(
    vocab: int, groups: int = 2, per_group: int = 4, prompt: int = 200, seed: int = 0
) -> list[Trajectory]:
    """GRPO groups: each group's episodes start with its prompt (mask 0), then continue on their own."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        start = [rng.randrange(vocab) for _ in range(prompt)]
        for i in range(per_group):
            rest = rng.randint(40, 300)
            mask = [0] * prompt + [1 if (j // 24) % 2 == 0 else 0 for j in range(rest)]
            out.append(
                Trajectory(
                    task_id=f"t{g}",
                    group_id=f"g{g}",
                    token_ids=start + [rng.randrange(vocab) for _ in range(rest)],
                    loss_mask=mask,
                    behavior_logprobs=[-7.8 if m else 0.0 for m in mask],
                    prompt_len=prompt,
                    reward=float(i % 2),
                    passed=bool(i % 2),
                    finish_reason="submitted",
                    policy_version=0,
                )
            )
    return out


def test_the_varlen_kernel_runs_shared_prefixes_with_the_reference_outputs_and_gradients() -> None:
    """One varlen call over a shared-prefix row (each remainder's keys gathered behind the prefix's; flash
    attention's bottom-right causal alignment): the fp32 reference's outputs and q/k/v gradients, to bf16."""
    from agentrl.train import varlen

    assert varlen.bottom_right_causal(CUDA), (
        "the varlen kernel should align causal attention to the bottom right"
    )
    torch.manual_seed(0)
    prefix, rests = 1000, [300, 7, 1200, 0, 500]
    cu = torch.tensor([0, *torch.tensor([prefix, *rests]).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    n = prefix + sum(rests)
    q = torch.randn(1, 12, n, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)  # GQA, as 1.5B
    k = torch.randn(1, 2, n, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, n, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    module = torch.nn.Module()
    fast, _ = varlen.varlen_attention(module, q, k, v, None, scaling=128**-0.5, cu_seq_lens_q=cu,
                                      cu_seq_lens_k=cu, shared_prefix_len=prefix)  # fmt: skip
    weights = torch.randn_like(fast, dtype=torch.float32)
    fast_grads = torch.autograd.grad((fast.float() * weights).sum(), (q, k, v))
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    layout = varlen.shared_prefix_layout(cu, prefix)
    ref = varlen._reference_varlen(
        q32[0].transpose(0, 1), k32[0].transpose(0, 1)[layout.keys], v32[0].transpose(0, 1)[layout.keys],
        layout.q_bounds, 128**-0.5, cu_k=layout.k_bounds,
    )[None]  # fmt: skip
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q32, k32, v32))
    # Attention outputs are averages of values of size ~1: bf16 rounding leaves ~1e-2 at most.
    assert (fast.float() - ref).abs().max().item() < 2e-2
    for name, got, want in zip("qkv", fast_grads, ref_grads, strict=True):
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, f"d{name}: relative difference {err:.2e}"


def test_shared_prefixes_on_the_gpu_give_the_unshared_step_and_compute_less(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
) -> None:
    trajs = grpo_groups(2543)
    optim = {"packing": "on", "max_tokens_per_micro_batch": 2048, "compile": "off"}
    off, m_off = step(tiny_model_dir, one_rank_group, trajs, share_prefix="off", **optim)
    on, m_on = step(tiny_model_dir, one_rank_group, trajs, share_prefix="on", **optim)
    assert m_on["losses/policy_loss"] == pytest.approx(m_off["losses/policy_loss"], rel=2e-2, abs=1e-4)
    assert_same_gradients(off, on, rel=0.1)  # two bf16 layouts of one attention: rounding
    assert m_on["batch/tokens_computed"] <= m_off["batch/tokens_computed"] - 2 * 3 * 200  # prompts once


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_layers_on_the_gpu_give_the_eager_step(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    checkpointing: bool,
) -> None:
    """Triton's fused elementwise kernels (what `optim.compile: auto` picks on CUDA) against the eager layers,
    on the shared-prefix layout: the same loss and gradients to bf16 rounding."""
    from agentrl.train.compiled import compile_works, resolve_compile

    assert compile_works("cuda") is None, compile_works("cuda")
    assert resolve_compile("auto", CUDA) is True
    trajs = grpo_groups(2543, seed=1)
    optim = {"packing": "on", "share_prefix": "on", "activation_checkpointing": checkpointing}
    eager, m_eager = step(tiny_model_dir, one_rank_group, trajs, compile="off", **optim)
    fused, m_fused = step(tiny_model_dir, one_rank_group, trajs, compile="on", **optim)
    assert m_fused["losses/policy_loss"] == pytest.approx(m_eager["losses/policy_loss"], rel=2e-2, abs=1e-4)
    assert_same_gradients(eager, fused, rel=0.1)


def test_the_gpu_defaults_pack_share_prefixes_and_compile(one_rank_group) -> None:  # noqa: F811
    from agentrl.train.compiled import resolve_compile
    from agentrl.train.update import trainer_layout

    cfg = TrainConfig(model="m")
    assert trainer_layout(cfg, one_rank_group) == (True, True)
    assert resolve_compile(cfg.optim.compile, one_rank_group.device) is True


# --- GPU weight transfer (needs vLLM's CUDA build as well) ---------------------------------------------


def bf16_rounded(model_dir: Path):
    """The fp32 model whose weights went through bf16: what the engine holds after a bf16 push."""
    model = load(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


@pytest.mark.vllm
@pytest.mark.slow
def test_colocated_engine_sleeps_and_takes_weights_by_cuda_ipc(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    tmp_path,
) -> None:
    from transformers import AutoModelForCausalLM

    from agentrl.kit.tiny_model import init_tiny
    from agentrl.rollout.engine import without_torchrun_env
    from agentrl.rollout.placement import plan_placement
    from agentrl.rollout.policy import HFPolicy, SamplingConfig, VLLMPolicy
    from agentrl.rollout.weight_sync import WeightSync
    from agentrl.train.distributed import shard_model

    other = init_tiny(tmp_path / "seed1", seed=1)
    placement = plan_placement(gpus=torch.cuda.device_count(), nproc=1, gpu_memory_utilization=0.3)
    assert placement.colocated and placement.sleep and placement.transport == "ipc"
    with without_torchrun_env():  # the engine's processes must not join this test's process group
        policy = VLLMPolicy(tiny_model_dir, dtype="float32", max_model_len=512, **placement.engine_kwargs())
    try:
        trainer = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).to(CUDA)
        shard_model(trainer, bf16=True)
        sync = WeightSync(placement, policy, trainer, one_rank_group)
        sync.before_update()
        assert policy.sleeping
        assert sync.after_update() == 1 and not policy.sleeping
        greedy = SamplingConfig(temperature=0.0, max_tokens=8)
        import asyncio

        gen = asyncio.run(policy.generate([5, 6, 7, 8], greedy))
        # Weights travelled in bf16: the engine now runs the other model, its weights rounded to bf16.
        ref = HFPolicy(bf16_rounded(other)).generate_sync([5, 6, 7, 8], greedy)
        assert gen.token_ids[:4] == ref.token_ids[:4]
        sync.close()
    finally:
        policy.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_dedicated_engine_takes_weights_over_nccl(tiny_model_dir, one_rank_group, tmp_path) -> None:  # noqa: F811
    if torch.cuda.device_count() < 2:
        pytest.skip("a dedicated engine needs a second GPU")
    from transformers import AutoModelForCausalLM

    from agentrl.kit.tiny_model import init_tiny
    from agentrl.rollout.engine import without_torchrun_env
    from agentrl.rollout.placement import plan_placement
    from agentrl.rollout.policy import HFPolicy, SamplingConfig, VLLMPolicy
    from agentrl.rollout.weight_sync import WeightSync
    from agentrl.train.distributed import shard_model

    other = init_tiny(tmp_path / "seed1", seed=1)
    placement = plan_placement(gpus=torch.cuda.device_count(), nproc=1, devices=[1])
    assert not placement.colocated and placement.transport == "nccl"
    with without_torchrun_env():  # the engine's processes must not join this test's process group
        policy = VLLMPolicy(tiny_model_dir, dtype="float32", max_model_len=512, **placement.engine_kwargs())
    try:
        trainer = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).to(CUDA)
        shard_model(trainer, bf16=True)
        sync = WeightSync(placement, policy, trainer, one_rank_group)
        assert sync.after_update() == 1
        assert sync.after_update() == 2  # the NCCL group is set up once and reused
        greedy = SamplingConfig(temperature=0.0, max_tokens=8)
        import asyncio

        gen = asyncio.run(policy.generate([5, 6, 7, 8], greedy))
        ref = HFPolicy(bf16_rounded(other)).generate_sync([5, 6, 7, 8], greedy)
        assert gen.token_ids[:4] == ref.token_ids[:4]
        sync.close()
    finally:
        policy.close()


# --- what the GPU path had never run: packing with checkpointing, chunks, cycles, ranks, async --------------


def test_packing_with_activation_checkpointing_on_the_gpu(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    monkeypatch,
) -> None:
    """Packed micro-batches through the varlen kernel with every layer recomputed in backward: the same
    gradients as without checkpointing, and every kernel call given the longest sequence of its row."""
    from agentrl.train import varlen

    seen: list[tuple[int, int]] = []
    real = varlen._flash_varlen

    def spy(q, k, v, cu, max_len, scale, **kw):
        seen.append((max_len, int((cu[1:] - cu[:-1]).max())))
        return real(q, k, v, cu, max_len, scale, **kw)

    monkeypatch.setattr(varlen, "_flash_varlen", spy)
    trajs = batch_of(2543)
    optim = {"packing": "on", "max_tokens_per_micro_batch": 1024}
    off, m_off = step(tiny_model_dir, one_rank_group, trajs, activation_checkpointing=False, **optim)
    calls_without = len(seen)
    on, m_on = step(tiny_model_dir, one_rank_group, trajs, activation_checkpointing=True, **optim)
    assert calls_without > 0 and len(seen) - calls_without > calls_without  # recomputed in backward
    assert all(given == longest > 0 for given, longest in seen), seen[:5]
    assert m_on["losses/policy_loss"] == pytest.approx(m_off["losses/policy_loss"], rel=1e-3, abs=1e-5)
    assert_same_gradients(off, on, rel=2e-2)


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (two trainer ranks)")


@pytest.mark.vllm
@pytest.mark.slow
def test_colocated_push_in_chunks_over_repeated_sleep_wake_cycles(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    tmp_path,
) -> None:
    """One GPU: three sleep -> push -> wake cycles with generation between, alternating two models, pushed in
    chunks of 512 KiB (many chunks); then a push with a 256 MiB buffer, after which the trainer's process
    keeps none of it: the buffer went back to the driver before the KV cache woke."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from agentrl.kit.tiny_model import init_tiny
    from agentrl.rollout.engine import without_torchrun_env
    from agentrl.rollout.placement import plan_placement
    from agentrl.rollout.policy import HFPolicy, SamplingConfig, VLLMPolicy
    from agentrl.rollout.weight_sync import WeightSync
    from agentrl.train.distributed import shard_model

    other = init_tiny(tmp_path / "seed1", seed=1)
    placement = plan_placement(gpus=torch.cuda.device_count(), nproc=1, gpu_memory_utilization=0.3)
    with without_torchrun_env():
        policy = VLLMPolicy(tiny_model_dir, dtype="float32", max_model_len=512, **placement.engine_kwargs())
    greedy = SamplingConfig(temperature=0.0, max_tokens=8)
    prompt = [5, 6, 7, 8]
    try:
        refs = {
            d: HFPolicy(bf16_rounded(d)).generate_sync(prompt, greedy).token_ids
            for d in (tiny_model_dir, other)
        }
        for cycle, target in enumerate((other, tiny_model_dir, other), start=1):
            trainer = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(CUDA)
            shard_model(trainer, bf16=True)
            sync = WeightSync(placement, policy, trainer, one_rank_group, chunk_bytes=1 << 19)
            sync.before_update()
            assert policy.sleeping
            assert sync.after_update() == cycle and not policy.sleeping
            assert sync._sender.chunks_sent > 3
            gen = asyncio.run(policy.generate(prompt, greedy))
            assert gen.token_ids[:4] == refs[target][:4], f"cycle {cycle}"
            sync.close()
        big = 256 << 20
        sync = WeightSync(placement, policy, trainer, one_rank_group, chunk_bytes=big)
        torch.cuda.reset_peak_memory_stats()
        sync.before_update()
        sync.after_update()
        assert torch.cuda.max_memory_allocated() >= big  # the buffer was staged here ...
        assert torch.cuda.memory_reserved() < big  # ... and is not kept beside the engine's KV cache
        sync.close()
    finally:
        policy.close()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine_gpus", "chunk_mib"),
    [("0", "0.5"), ("0", "256"), ("0,1", "0.5")],
    ids=["one-gpu-engine-many-chunks", "one-gpu-engine-big-buffer", "tensor-parallel-engine"],
)
def test_two_trainer_ranks_push_by_cuda_ipc(
    tiny_model_dir,  # noqa: F811
    tmp_path,
    engine_gpus: str,
    chunk_mib: str,
) -> None:
    """Two trainer ranks (FSDP gathers during the push, the IPC handle all-gather), three sleep/push/wake
    cycles with generation between. With the engine on GPU 0 only, rank 1 stages nothing (its peak stays
    under the 256 MiB buffer rank 0 needed); tensor-parallel over both GPUs, both stage."""
    _two_gpus()
    from agentrl.kit.tiny_model import init_tiny
    from tests.train.rank_cases import launch

    other = init_tiny(tmp_path / "seed1", seed=1)
    res = launch(
        "gpu_ipc_push", tmp_path / "out", str(tiny_model_dir), str(other), engine_gpus, chunk_mib, cpu=False
    )
    assert res[-1]["returncode"] == 0, (res.get(0), res.get(1), res[-1]["stderr"])
    r0, r1 = res[0], res[1]
    # bf16 weights in two engines' kernels: the first tokens agree (as in the one-GPU tests above).
    assert all(g[:4] == e[:4] for g, e in zip(r0["generated"], r0["expected"], strict=True))
    assert r0["versions"] == [1, 2, 3] and r1["versions"] == [None, None, None]
    assert r1["stages"] == ("1" in engine_gpus.split(","))
    if chunk_mib == "0.5":
        assert r0["chunks"] == r1["chunks"] > 3
    else:
        big = 256 << 20
        assert min(r0["peak_allocated"]) >= big > max(r1["peak_allocated"])
        assert max(r0["reserved_after"]) < big


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_train_end_to_end_with_a_colocated_bf16_engine(tiny_model_dir, tmp_path, mode: str) -> None:  # noqa: F811
    """`train()` on one GPU: the engine colocated (bf16, vLLM's choice on a GPU), sleeping through each
    update in sync mode, awake and generating the next batch in async mode; every step pushes by CUDA IPC."""
    from tests.train.test_trainer import run

    cfg = TrainConfig(
        env="tests.coin_env:test/Coin-v0",
        model=str(tiny_model_dir),
        out=str(tmp_path / mode),
        steps=3,
        rollout={"group_size": 4, "max_tokens_per_turn": 12, "max_total_tokens": 512, "concurrency": 8},
        curriculum={"batch_groups": 2, "max_gen_factor": 3.0},
        optim={"lr": 1e-4, "micro_batch_size": 4},
        engine={"gpu_memory_utilization": 0.3, "weight_chunk_mib": 1},
        asynchronous={"mode": mode, "max_staleness": 1},
    )
    rows = run(cfg, 1, cpu=False)
    assert [r["policy/version"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["time/weight_sync_s"] > 0 for r in rows)
    assert (tmp_path / mode / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_nccl_ranks_wait_for_rank_0_longer_than_the_collective_timeout(tmp_path) -> None:
    """NCCL's watchdog aborts a collective that waits past the group's timeout: rank 1 waits on the store
    instead while rank 0 works alone for three times that timeout, then both broadcast."""
    _two_gpus()
    from tests.train.rank_cases import launch

    res = launch("wait_for_main", tmp_path, "wait", cpu=False)
    assert res[-1]["returncode"] == 0, (res.get(1), res[-1]["stderr"])
    assert res[1]["got"] == {"batch": 42} and res[1]["waited_s"] > 4.0


@pytest.mark.vllm
@pytest.mark.slow
def test_sleep_on_the_gpu_waits_a_bounded_time_for_running_requests(tiny_model_dir) -> None:  # noqa: F811
    """The engine in its own process (vLLM's AsyncLLM), sleep mode on: a request that outlasts the wait makes
    `sleep` fail with the count instead of blocking the update; once it is done, the engine sleeps and wakes."""
    import asyncio
    import threading
    import time

    from agentrl.rollout.engine import without_torchrun_env
    from agentrl.rollout.placement import plan_placement
    from agentrl.rollout.policy import EngineBusyError, SamplingConfig, VLLMPolicy

    placement = plan_placement(gpus=torch.cuda.device_count(), nproc=1, gpu_memory_utilization=0.3)
    with without_torchrun_env():
        policy = VLLMPolicy(tiny_model_dir, max_model_len=8192, **placement.engine_kwargs())
    try:
        long = SamplingConfig(temperature=0.0, max_tokens=8000, ignore_eos=True)
        done: dict[str, object] = {}
        worker = threading.Thread(
            target=lambda: done.setdefault("gen", asyncio.run(policy.generate([5, 6], long)))
        )
        worker.start()
        while policy.unfinished_requests() == 0:
            time.sleep(0.01)
        with pytest.raises(EngineBusyError, match=r"still runs 1 request\(s\) 0.05 s after"):
            policy.sleep(2, wait_s=0.05)
        assert not policy.sleeping
        worker.join(timeout=300)
        assert len(done["gen"].token_ids) == 8000
        policy.sleep(2)
        assert policy.sleeping
        policy.wake_up()
        assert asyncio.run(policy.generate([5, 6], SamplingConfig(temperature=0.0, max_tokens=4))).token_ids
    finally:
        policy.close()


def test_lora_trains_only_the_adapters_on_the_gpu_packed_bf16(tiny_model_dir, one_rank_group) -> None:  # noqa: F811
    """LoRA under FSDP2 on NCCL with bf16 compute and packed varlen attention: the rewarded trajectories'
    actions become likelier over steps on one batch, the base weights do not move, and the pushed adapter
    holds the trained values."""
    from safetensors.torch import load as load_safetensors

    from agentrl.rollout.weight_sync import checkpoint_name, full_state_dict
    from agentrl.train.batch import collate
    from agentrl.train.distributed import shard_model
    from agentrl.train.logprobs import action_logprobs
    from agentrl.train.lora import adapter_files, apply_lora, trainable_parameters
    from agentrl.train.update import grpo_step

    trajs = batch_of(2543)
    cfg = TrainConfig(
        model={"path": str(tiny_model_dir), "lora": {"rank": 8, "alpha": 16}},
        optim={"lr": 1e-2, "bf16": True, "packing": "on", "max_tokens_per_micro_batch": 1024},
    )
    torch.manual_seed(0)
    model = load(tiny_model_dir)
    apply_lora(model, cfg.model.lora, tiny_model_dir)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    shard_model(model, bf16=True)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=cfg.optim.lr)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if "lora_" in n
    }
    rewarded = collate([t for t in trajs if t.reward > 0], pad_id=0).to(CUDA)

    def rewarded_logprob() -> float:
        with torch.no_grad():
            lp = action_logprobs(model, rewarded, temperature=1.0, packed=True).logprobs  # [B, T]
        return float(lp.sum() / rewarded.loss_mask.sum())

    before = rewarded_logprob()
    for _ in range(4):
        metrics = grpo_step(model, opt, trajs, cfg, one_rank_group, pad_id=0)
        assert torch.isfinite(torch.tensor(metrics["losses/policy_loss"])) and metrics["losses/grad_norm"] > 0
    assert rewarded_logprob() > before + 0.01
    # The fp32 master weights (the sharded parameters, gathered): named_parameters() may show the bf16
    # unsharded copies the last forward left.
    master = {checkpoint_name(k): v for k, v in full_state_dict(model).items()}
    for n, before_value in base_before.items():
        assert torch.equal(master[n].to(before_value.device), before_value), n
    files = adapter_files(model)
    assert files is not None
    tensors = load_safetensors(files["adapter_model.safetensors"])
    assert any(float(t.abs().max()) > 0 for k, t in tensors.items() if "lora_B" in k)  # B left its zero start
