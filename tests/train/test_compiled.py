"""Compiled decoder layers (`optim.compile`): the log-probs and gradients of the eager model, one compile for
every layer and every micro-batch length, and the setting's resolution.

Most tests compile with the `aot_eager` backend: the same graph capture, graph breaks around the attention,
guards and autograd as Inductor, without generating code, so they run in seconds. One test runs Inductor
itself (C++ kernels on the CPU); the GPU's Triton kernels are checked by `tests/train/test_gpu.py`.
"""

from __future__ import annotations

import random

import pytest
import torch

from agentrl.rollout.trajectory import Trajectory
from agentrl.train import compiled
from agentrl.train.batch import collate
from agentrl.train.config import TrainConfig
from agentrl.train.logprobs import action_logprobs
from tests.fixtures_dist import assert_same_gradients, grpo_step_gradients, one_rank_group  # noqa: F401
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

VOCAB = 2543


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts from no compiled code (the compiled functions are cached per layer class)."""
    torch._dynamo.reset()
    compiled._compiled.cache_clear()
    yield
    torch._dynamo.reset()
    compiled._compiled.cache_clear()


def group_batch(seed: int = 0, prompt: int = 40, n: int = 4) -> list[Trajectory]:
    """A GRPO group: `n` episodes of one task, the prompt (mask 0) then different continuations, rewards 0/1."""
    rng = random.Random(seed)
    start = rng.choices(range(VOCAB), k=prompt)
    out = []
    for i in range(n):
        rest = rng.randint(8, 40)
        mask = [0] * prompt + [1 if (j // 5) % 2 == 0 else 0 for j in range(rest)]
        out.append(
            Trajectory(
                task_id=f"t{seed}",
                group_id=f"g{seed}",
                token_ids=start + rng.choices(range(VOCAB), k=rest),
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


def load(model_dir, *, compile_backend: str | None = None, checkpointing: bool = False):
    from transformers import AutoModelForCausalLM

    from agentrl.train.distributed import _decoder_layers, shard_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shard_model(model, activation_checkpointing=checkpointing, bf16=False)
    if compile_backend is not None:
        layers = _decoder_layers(model)
        assert compiled.compile_layers(model, layers, backend=compile_backend) == len(layers) > 0
        assert compiled.compile_layers(model, layers, backend=compile_backend) == 0  # idempotent
    return model


def logprobs_and_grads(model, batch, **layout):
    out = action_logprobs(model, batch, with_entropy=True, **layout)
    weights = torch.linspace(0.5, 1.5, out.logprobs.numel()).view_as(out.logprobs)
    (out.logprobs * weights).sum().backward()
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): (
            p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        ).clone()
        for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return out.logprobs.detach(), out.entropy, grads


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("layout", "checkpointing"),
    [
        pytest.param({"packed": True, "share_prefix": True}, True, id="shared-prefix-checkpointed"),
        pytest.param({"packed": True, "share_prefix": True}, False, id="shared-prefix", marks=SLOW),
        pytest.param({"packed": True}, False, id="packed", marks=SLOW),
        pytest.param({"packed": False}, False, id="padded", marks=SLOW),
        pytest.param({"packed": False}, True, id="padded-checkpointed", marks=SLOW),
    ],
)
def test_compiled_layers_give_the_eager_logprobs_and_gradients(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    checkpointing: bool,
    layout: dict,
) -> None:
    batch = collate(group_batch(), pad_id=0)
    eager = load(tiny_model_dir, checkpointing=checkpointing)
    ref_logp, ref_ent, ref_grads = logprobs_and_grads(eager, batch, **layout)
    fused = load(tiny_model_dir, compile_backend="aot_eager", checkpointing=checkpointing)
    logp, ent, grads = logprobs_and_grads(fused, batch, **layout)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    assert_same_gradients(ref_grads, grads, rel=1e-5)


def test_one_compile_serves_every_layer_and_every_length(tiny_model_dir, one_rank_group) -> None:  # noqa: F811
    """The layers share one compiled function; micro-batches of other lengths and other prefixes reuse it
    (dynamic shapes): only grad mode, the padded layout and the prefix's presence are variants of their own."""
    from torch._dynamo.utils import counters

    model = load(tiny_model_dir, compile_backend="aot_eager")
    counters.clear()
    for seed in range(3):  # three lengths, three prefixes
        logprobs_and_grads(model, collate(group_batch(seed, prompt=35 + seed), pad_id=0), packed=True)
    after_grad = counters["stats"]["unique_graphs"]
    for seed in range(3, 6):
        logprobs_and_grads(model, collate(group_batch(seed, prompt=35 + seed), pad_id=0), packed=True)
    assert counters["stats"]["unique_graphs"] == after_grad  # nothing new to compile
    with torch.no_grad():
        for seed in range(2):
            action_logprobs(model, collate(group_batch(seed), pad_id=0), packed=True, share_prefix=True)
    # A layer is two graphs split at the attention (plus the attention module's own frame): a handful in
    # all, however many layers and micro-batches, never one per layer.
    assert counters["stats"]["unique_graphs"] <= 16
    assert not counters["recompiles"] or sum(counters["recompiles"].values()) <= 8


@pytest.mark.slow
def test_inductor_on_the_cpu_gives_the_eager_numbers(tiny_model_dir, one_rank_group) -> None:  # noqa: F811
    """The fused C++ kernels Inductor generates on the CPU (the GPU path generates Triton ones). Inductor needs
    a C++ compiler; on a machine without one, `compile: on` must refuse in one line instead."""
    why = compiled.compile_works("cpu")
    if why is not None:
        with pytest.raises(RuntimeError, match="torch.compile does not work on cpu here"):
            compiled.resolve_compile("on", torch.device("cpu"))
        return
    batch = collate(group_batch(), pad_id=0)
    layout = {"packed": True, "share_prefix": True}
    ref_logp, _, ref_grads = logprobs_and_grads(load(tiny_model_dir), batch, **layout)
    logp, _, grads = logprobs_and_grads(load(tiny_model_dir, compile_backend="inductor"), batch, **layout)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-4, atol=1e-4)
    # Fused kernels sum in another order: fp32 rounding, relative to each tensor's scale.
    assert_same_gradients(ref_grads, grads, rel=1e-4)


@pytest.mark.slow
def test_the_trainer_step_with_compiled_layers_gives_the_eager_loss_and_gradients(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    monkeypatch,
) -> None:
    trajs = [t for seed in range(2) for t in group_batch(seed)]
    cfg = TrainConfig(model=str(tiny_model_dir), optim={"grad_clip": 1e9, "compile": "off"})
    ref, ref_m = grpo_step_gradients(tiny_model_dir, one_rank_group, cfg, trajs)
    monkeypatch.setattr(compiled, "compile_works", lambda device_type: None)
    real = compiled.compile_layers
    monkeypatch.setattr(
        compiled,
        "compile_layers",
        lambda model, layers, backend="inductor": real(model, layers, backend="aot_eager"),
    )
    on = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"compile": "on"})})
    grads, m = grpo_step_gradients(tiny_model_dir, one_rank_group, on, trajs)
    assert m["losses/policy_loss"] == pytest.approx(ref_m["losses/policy_loss"], rel=1e-5, abs=1e-8)
    assert_same_gradients(ref, grads)


def test_the_setting_compiles_on_cuda_where_it_works_and_never_silently_on_request(monkeypatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compiled.resolve_compile("off", cuda) is False
    assert compiled.resolve_compile("auto", cpu) is False  # compile time is not repaid on the CPU
    monkeypatch.setattr(compiled, "compile_works", lambda device_type: None)
    assert compiled.resolve_compile("auto", cuda) is True
    assert compiled.resolve_compile("on", cpu) is True
    monkeypatch.setattr(compiled, "compile_works", lambda device_type: "RuntimeError: no working C compiler")
    assert compiled.resolve_compile("auto", cuda) is False  # eager, with a warning
    with pytest.raises(RuntimeError, match="optim.compile: on, but torch.compile does not work on cpu"):
        compiled.resolve_compile("on", cpu)
    with pytest.raises(ValueError, match="auto, on or off"):
        compiled.resolve_compile("yes", cpu)
    with pytest.raises(ValueError, match="compile"):
        TrainConfig(model="m", optim={"compile": "maybe"})


@pytest.mark.parametrize("with_entropy", [True, False])
def test_the_fused_head_gives_the_eager_logprobs_entropies_and_gradients(with_entropy: bool) -> None:
    """The log-prob head's elementwise work per chunk as compiled kernels (what compiled layers switch on),
    against the eager in-place code: several chunks, a temperature, bf16-free fp32."""
    from agentrl.train.logprobs import ChunkedLogProbs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = (0.5 * torch.randn(300, 16, generator=g)).requires_grad_()
    targets = torch.randint(0, 300, (37,), generator=g)
    upstream = torch.randn(37, generator=g)

    def run(fused):
        logp, ent = ChunkedLogProbs.apply(hidden, weight, None, targets, 0.8, 10, with_entropy, fused)
        grads = torch.autograd.grad((logp * upstream).sum(), (hidden, weight))
        return logp.detach(), ent, grads

    ref_logp, ref_ent, ref_grads = run(None)
    logp, ent, grads = run("aot_eager")
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-6)
    assert ent.numel() == (37 if with_entropy else 0)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
