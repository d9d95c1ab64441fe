"""LoRA in the rollout engine: vLLM serving peft adapters on the tiny model, pushed as bytes or named.

The adapters are made by peft itself (`get_peft_model` on the tiny model, every lora_B set to random
values so the adapter changes what the model says, `save_pretrained`), and the reference is a
transformers `PeftModel` loaded from the same directory.

Tolerance: vLLM's float32 log-probs with an adapter must match the PeftModel's within 1e-4, the bound
the base model's own comparison uses (tests/rollout/test_policy.py); measured about 3e-6 here. The
adapters move the log-probs of the same tokens by far more than that (asserted: over 0.05), so a match
says the adapter was applied, and applied exactly.

One in-process engine (`LLMEngine`) serves the module; the `AsyncLLM` engine (its own process) and
the Ray engines start in the tests marked slow.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from agentrl.core.errors import UserError
from agentrl.rollout.adapters import ADAPTER_CONFIG, ADAPTER_FILES, ADAPTER_WEIGHTS
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.engine import make_policy
from agentrl.rollout.policy import HFPolicy, SamplingConfig, VLLMPolicy
from tests import fixtures_model
from tests.rollout.score import score_logprobs

tiny_model_dir = fixtures_model.tiny_model_dir  # the session-wide tiny model, as a fixture of this module

TOL = 1e-4
MOVED = 0.05  # the least an adapter moves the log-prob of some sampled token away from the base model's
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300, 400]]
START_VERSION = 3  # the engine starts with an adapter as a resumed LoRA run does
GREEDY = SamplingConfig(temperature=0.0, max_tokens=8)
SAMPLED = SamplingConfig(temperature=0.7, max_tokens=8, seed=11)


def make_adapter(base: Path, out: Path, *, seed: int, rank: int = 8) -> Path:
    """A peft LoRA adapter for `base` on every linear layer, with lora_B random (not peft's zeros)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # lora_A's initialisation
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    peft.save_pretrained(out)
    return out


def adapter_bytes(path: Path) -> dict[str, bytes]:
    """An adapter as the trainer pushes it."""
    return {name: (path / name).read_bytes() for name in ADAPTER_FILES}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(tiny_model_dir, root / "a", seed=1),
        "b": make_adapter(tiny_model_dir, root / "b", seed=2),
        "wide": make_adapter(tiny_model_dir, root / "wide", seed=3, rank=16),
    }


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, adapters: dict[str, Path]) -> dict[str, Any]:
    """transformers models to score against: the base, and a PeftModel per adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def base() -> Any:
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    refs = {name: PeftModel.from_pretrained(base(), adapters[name]).eval() for name in ("a", "b")}
    return {"base": base(), **refs}


def diff(model: Any, prompt: list[int], gen: Any, temperature: float) -> float:
    """Largest |log-prob difference| between a generation and `model`'s scoring of its tokens."""
    ref = score_logprobs(model, prompt + gen.token_ids, temperature=temperature or 1.0)[len(prompt) :]
    return max(abs(a - b) for a, b in zip(ref, gen.logprobs, strict=True))


def gather(policy: Any, requests: list[tuple[list[int], SamplingConfig]]) -> list[Any]:
    async def run() -> list[Any]:
        return await asyncio.gather(*(policy.generate(p, s) for p, s in requests))

    return asyncio.run(run())


def check(policy: Any, references: dict[str, Any], name: str, adapter: str | None = None) -> float:
    """Greedy and sampled generations of `policy` (selecting `adapter`) against reference `name`; the worst |diff|."""
    worst = 0.0
    for sampling in (GREEDY, SAMPLED):
        sampling = sampling.model_copy(update={"adapter": adapter})
        for prompt, gen in zip(PROMPTS, gather(policy, [(p, sampling) for p in PROMPTS]), strict=True):
            worst = max(worst, diff(references[name], prompt, gen, sampling.temperature))
    assert worst < TOL, f"{name}: max |diff| {worst:.2e}"
    return worst


# --- without vLLM -----------------------------------------------------------------------------------------


def test_hf_policy_loads_pushed_and_named_adapters(tiny_model_dir: Path, adapters, references) -> None:
    hf = HFPolicy(tiny_model_dir)
    base = hf.generate_sync(PROMPTS[0], SAMPLED)
    assert diff(references["base"], PROMPTS[0], base, 0.7) < 1e-5
    assert hf.load_adapter(adapter_bytes(adapters["a"])) == 1
    gen = hf.generate_sync(PROMPTS[0], SAMPLED)
    assert gen.policy_version == 1 and diff(references["a"], PROMPTS[0], gen, 0.7) < 1e-5
    assert diff(references["base"], PROMPTS[0], gen, 0.7) > MOVED  # the adapter is applied
    assert hf.load_adapter(adapters["b"], version=7) == 7  # a directory, numbered by the caller
    assert diff(references["b"], PROMPTS[0], hf.generate_sync(PROMPTS[0], SAMPLED), 0.7) < 1e-5
    hf.add_adapter("a", adapters["a"])
    named = hf.generate_sync(PROMPTS[0], SAMPLED.model_copy(update={"adapter": "a"}))
    assert diff(references["a"], PROMPTS[0], named, 0.7) < 1e-5 and named.policy_version == 7
    with pytest.raises(UserError, match="no LoRA adapter named 'c'"):
        hf.generate_sync(PROMPTS[0], SAMPLED.model_copy(update={"adapter": "c"}))
    with pytest.raises(ValueError, match=ADAPTER_WEIGHTS):
        hf.load_adapter({ADAPTER_CONFIG: b"{}"})
    assert hf.version == 7


# --- one in-process vLLM engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path, adapters: dict[str, Path]):
    p = make_policy(
        tiny_model_dir,
        RolloutConfig(max_total_tokens=512),
        dtype="float32",
        in_process=True,
        version=START_VERSION,
        lora_rank=5,  # vLLM serves ranks 1, 8, 16, ...: the engine holds up to 8
        adapter=adapters["a"],
    )
    yield p
    p.close()


@pytest.mark.vllm
def test_engine_lora_rank_is_the_smallest_rank_vllm_accepts() -> None:
    from agentrl.rollout.policy import engine_lora_rank

    assert [engine_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 300, 512)] == [1, 8, 8, 16, 16, 32, 320, 512]
    with pytest.raises(UserError, match="above the largest"):
        engine_lora_rank(513)
    with pytest.raises(UserError, match="at least 1"):
        engine_lora_rank(0)


@pytest.mark.vllm
def test_the_adapter_the_engine_started_with_is_applied_as_peft_applies_it(
    policy, adapters, references
) -> None:
    assert isinstance(policy, VLLMPolicy) and policy.max_lora_rank == 8
    assert policy.engine_kwargs["enable_lora"] is True and policy.engine_kwargs["max_lora_rank"] == 8
    assert policy.current_adapter is not None and policy.current_adapter.path == adapters["a"]
    assert policy.current_adapter.version == policy.version == START_VERSION
    worst = check(policy, references, "a")
    print(f"vLLM vs PeftModel, adapter a: max |diff| {worst:.2e}")
    gens = gather(policy, [(p, SAMPLED) for p in PROMPTS])
    assert {g.policy_version for g in gens} == {g.policy_version_end for g in gens} == {START_VERSION}
    moved = max(diff(references["base"], p, g, 0.7) for p, g in zip(PROMPTS, gens, strict=True))
    assert moved > MOVED, f"the adapter moves the log-probs by only {moved:.2e}"


@pytest.mark.vllm
def test_pushes_switch_new_requests_while_requests_in_flight_keep_their_adapter(
    policy, adapters, references
) -> None:
    started = policy.current_adapter
    v = policy.load_adapter(adapter_bytes(adapters["b"]))
    assert v == policy.version == START_VERSION + 1
    pushed_b = policy.current_adapter
    assert pushed_b.version == v and pushed_b.path.is_dir() and pushed_b.path != adapters["b"]
    # The adapter the engine started with no request carries: out of the engine, its directory (the
    # caller's) left alone.
    assert policy.engine_adapters() == {pushed_b.lora_id} and started.path.is_dir()
    check(policy, references, "b")
    assert gather(policy, [(PROMPTS[0], GREEDY)])[0].policy_version == v

    long = SamplingConfig(temperature=0.0, max_tokens=300, ignore_eos=True)

    async def push_during_a_request() -> tuple[Any, int, set[int], bool]:
        request = asyncio.create_task(policy.generate(PROMPTS[1], long))
        await asyncio.sleep(0)  # the request has picked its adapter (b)
        pushed = await asyncio.to_thread(policy.load_adapter, adapter_bytes(adapters["a"]))
        during = await asyncio.to_thread(policy.engine_adapters)
        still_running = not request.done()
        return await request, pushed, during, still_running

    gen, v2, during, still_running = asyncio.run(push_during_a_request())
    pushed_a = policy.current_adapter
    assert still_running, "the request ended before the push; make it longer"
    assert v2 == v + 1 and pushed_a.version == v2
    assert during == {pushed_b.lora_id, pushed_a.lora_id}  # b stays while the request carries it
    # Every token of the request was sampled with b, and it says so.
    assert gen.policy_version == gen.policy_version_end == v and len(gen.token_ids) == 300
    assert diff(references["b"], PROMPTS[1], gen, 0.0) < TOL
    # b's last request is done: it left the engine and its temporary directory is gone.
    assert policy.engine_adapters() == {pushed_a.lora_id}
    assert not pushed_b.path.exists() and pushed_a.path.is_dir()
    check(policy, references, "a")
    assert gather(policy, [(PROMPTS[0], GREEDY)])[0].policy_version == v2


@pytest.mark.vllm
def test_named_adapters_are_selected_per_request_in_one_batch(policy, adapters, references) -> None:
    policy.add_adapter("b", adapter_bytes(adapters["b"]))
    policy.add_adapter("a", adapters["a"])
    version = policy.version
    named = policy.named_adapters
    assert set(named) == {"a", "b"} and named["a"].version is None
    assert policy.engine_adapters() == {
        policy.current_adapter.lora_id,
        named["a"].lora_id,
        named["b"].lora_id,
    }
    # One batch: requests for b, for a, and for the pushed adapter (a, as pushed last), side by side.
    mixed = [(p, SAMPLED.model_copy(update={"adapter": name})) for p in PROMPTS for name in ("b", "a", None)]
    gens = gather(policy, mixed)
    for (prompt, sampling), gen in zip(mixed, gens, strict=True):
        assert diff(references[sampling.adapter or "a"], prompt, gen, 0.7) < TOL
        assert gen.policy_version == version  # a named adapter does not change the version
    with pytest.raises(UserError, match=r"no LoRA adapter named 'c' .*added: a, b"):
        gather(policy, [(PROMPTS[0], SAMPLED.model_copy(update={"adapter": "c"}))])
    # Adding a name again replaces its adapter: the old one leaves the engine, its directory is deleted.
    old_b = named["b"]
    policy.add_adapter("b", adapter_bytes(adapters["b"]))
    assert policy.named_adapters["b"].lora_id != old_b.lora_id and not old_b.path.exists()
    assert old_b.lora_id not in policy.engine_adapters()


@pytest.mark.vllm
def test_adapters_in_use_are_loaded_again_on_waking(policy, references) -> None:
    """A level-2 sleep drops vLLM's loaded adapters with the weights (on GPUs); waking loads them again
    from their directories. On the CPU sleep only pauses, so this checks the reload changes nothing."""
    ids = policy.engine_adapters()
    policy.sleep()
    policy.wake_up()
    assert policy.engine_adapters() == ids
    check(policy, references, "a")
    check(policy, references, "b", adapter="b")


@pytest.mark.vllm
def test_bad_adapters_get_one_clear_error_and_the_engine_keeps_serving(
    policy, adapters, references, tiny_model_dir: Path, tmp_path: Path
) -> None:
    before = (policy.version, policy.current_adapter, policy.named_adapters, policy.engine_adapters())
    scratch = policy.current_adapter.path.parent
    dirs = sorted(scratch.iterdir())
    with pytest.raises(ValueError, match=f"missing \\['{ADAPTER_WEIGHTS}'\\]"):
        policy.load_adapter({ADAPTER_CONFIG: (adapters["a"] / ADAPTER_CONFIG).read_bytes()})
    with pytest.raises(UserError, match="has rank 16, above this engine's max_lora_rank 8"):
        policy.load_adapter(adapter_bytes(adapters["wide"]))
    with pytest.raises(UserError, match="is not a LoRA adapter directory"):
        policy.load_adapter(tiny_model_dir)
    with pytest.raises(UserError, match="does not exist"):
        policy.add_adapter("x", tmp_path / "nothing")
    broken = {**adapter_bytes(adapters["a"]), ADAPTER_WEIGHTS: b"not safetensors"}
    with pytest.raises(UserError, match="vLLM could not load the pushed adapter"):
        policy.load_adapter(broken)  # vLLM itself refuses it: its error, in one UserError
    bad_config = {**adapter_bytes(adapters["a"]), ADAPTER_CONFIG: b"{oops"}
    with pytest.raises(UserError, match="not a readable LoRA adapter config"):
        policy.load_adapter(bad_config)
    with pytest.raises(UserError, match="non-empty name"):
        policy.add_adapter("", adapters["a"])
    # Nothing changed, no directory was left behind, and the engine serves as before.
    assert (policy.version, policy.current_adapter, policy.named_adapters, policy.engine_adapters()) == before
    assert sorted(scratch.iterdir()) == dirs
    check(policy, references, "a")


def test_an_engine_without_lora_refuses_adapters_before_vllm_sees_them(tmp_path: Path) -> None:
    """The check runs before anything reaches the engine: shown on a policy object that has none."""
    policy = VLLMPolicy.__new__(VLLMPolicy)
    policy._closed, policy.max_lora_rank = False, None
    with pytest.raises(UserError, match="started without LoRA"):
        policy._register(tmp_path, "pushed")


# --- the other engine set-ups ------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_async_engine_in_its_own_process_serves_pushed_adapters(
    tiny_model_dir: Path, adapters, references
) -> None:
    """AsyncLLM (engine core in another process): the same adapters, the same numbers."""
    with VLLMPolicy(
        tiny_model_dir, dtype="float32", max_model_len=512, adapter=adapters["a"], max_loras=2
    ) as policy:
        assert not policy.in_process and policy.max_lora_rank == 8  # from the adapter's own rank
        check(policy, references, "a")
        first = policy.current_adapter
        assert policy.load_adapter(adapter_bytes(adapters["b"])) == 1
        check(policy, references, "b")
        assert policy.engine_adapters() == {policy.current_adapter.lora_id} and first.path.is_dir()
        pushed_b = policy.current_adapter
        assert policy.load_adapter(adapter_bytes(adapters["a"])) == 2
        assert not pushed_b.path.exists()
        with pytest.raises(UserError, match="vLLM could not load"):
            policy.load_adapter({**adapter_bytes(adapters["a"]), ADAPTER_WEIGHTS: b"junk"})
        policy.add_adapter("b", adapters["b"])
        check(policy, references, "b", adapter="b")
        check(policy, references, "a")
        scratch = policy.current_adapter.path.parent
    assert not scratch.exists()  # close() deletes every pushed adapter's directory


@pytest.mark.vllm
@pytest.mark.slow
def test_ray_engines_each_load_the_pushed_adapter(
    ray_cluster, tiny_model_dir: Path, adapters, references
) -> None:
    """Two engines on two Ray nodes: a push (bytes through the object store) and a named adapter reach
    both, and an engine restarted after a crash loads them again."""
    from agentrl.rollout.ray_policy import EngineDied, RayPolicy

    with make_policy(
        tiny_model_dir,
        RolloutConfig(max_total_tokens=512),
        dtype="float32",
        ray_address=ray_cluster.address,
        engines=2,
        resources=[{"node_a": 1}, {"node_b": 1}],
        lora_rank=8,
        adapter=adapters["a"],  # both nodes run on this machine: the path reads on each
        version=START_VERSION,
    ) as policy:
        assert isinstance(policy, RayPolicy)

        def on_each_engine(sampling: SamplingConfig) -> list[Any]:
            # Two groups: the router sends each to the engine with the fewest groups in flight.
            from agentrl.rollout.cluster import episode_group

            async def one(group: str) -> Any:
                with episode_group(group):
                    return await policy.generate(PROMPTS[0], sampling)

            async def run() -> list[Any]:
                return list(await asyncio.gather(one("g0"), one("g1")))

            gens = asyncio.run(run())
            assert {policy.engine_of("g0"), policy.engine_of("g1")} == {0, 1}
            return gens

        for gen in on_each_engine(SAMPLED):
            assert gen.policy_version == START_VERSION and diff(references["a"], PROMPTS[0], gen, 0.7) < TOL
        assert policy.load_adapter(adapter_bytes(adapters["b"])) == START_VERSION + 1
        assert policy.versions() == [START_VERSION + 1] * 2
        for gen in on_each_engine(SAMPLED):
            assert (
                gen.policy_version == START_VERSION + 1 and diff(references["b"], PROMPTS[0], gen, 0.7) < TOL
            )
        policy.add_adapter("a", adapter_bytes(adapters["a"]))
        for gen in on_each_engine(SAMPLED.model_copy(update={"adapter": "a"})):
            assert diff(references["a"], PROMPTS[0], gen, 0.7) < TOL
        with pytest.raises(UserError, match="has rank 16"):
            policy.load_adapter(adapter_bytes(adapters["wide"]))
        assert policy.version == START_VERSION + 1 and policy.versions() == [START_VERSION + 1] * 2
        # A killed engine comes back serving what the others serve: the pushed adapter, the named one.
        os.kill(policy.engine_info()[1]["pid"], signal.SIGKILL)
        with pytest.raises(EngineDied):
            on_each_engine(SAMPLED)  # the request that finds engine 1 dead
        policy.wait_all_alive(timeout_s=300)
        assert policy.restarts[1] == 1 and policy.versions() == [START_VERSION + 1] * 2
        for gen in on_each_engine(SAMPLED):
            assert (
                gen.policy_version == START_VERSION + 1 and diff(references["b"], PROMPTS[0], gen, 0.7) < TOL
            )
        for gen in on_each_engine(SAMPLED.model_copy(update={"adapter": "a"})):
            assert diff(references["a"], PROMPTS[0], gen, 0.7) < TOL
