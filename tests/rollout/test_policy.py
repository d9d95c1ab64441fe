"""Policies against the transformers reference, and weight updates reaching the running vLLM engine.

Tolerance: vLLM's log-probs (float32, CPU) must match a transformers forward pass over the same ids
within 1e-4 (measured about 1e-6). A weight update is checked by loading a differently seeded tiny
model into the running engine: its greedy tokens and log-probs must then be that model's.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from agentrl.kit.tiny_model import init_tiny
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.engine import make_policy
from agentrl.rollout.policy import HFPolicy, Policy, SamplingConfig, VLLMPolicy
from tests import fixtures_model
from tests.rollout.score import score_logprobs

tiny_model_dir = fixtures_model.tiny_model_dir  # the session-wide tiny model, as a fixture of this module

TOL = 1e-4
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300, 400]]


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture and tokenizer, another weight seed."""
    return init_tiny(tmp_path_factory.getbasetemp() / "tiny-qwen2-seed1", seed=1)


START_VERSION = 3  # as a resumed run's engine starts


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path):
    p = make_policy(
        tiny_model_dir,
        RolloutConfig(max_total_tokens=1024),
        dtype="float32",
        in_process=True,
        version=START_VERSION,
    )
    yield p
    p.close()


def gather(policy: Policy, sampling: SamplingConfig, prompts=PROMPTS):
    async def run():
        return await asyncio.gather(*(policy.generate(p, sampling) for p in prompts))

    return asyncio.run(run())


def max_diff(model, prompt: list[int], gen, temperature: float) -> float:
    ref = score_logprobs(model, prompt + gen.token_ids, temperature=temperature)[len(prompt) :]
    return max(abs(a - b) for a, b in zip(ref, gen.logprobs, strict=True))


@pytest.mark.vllm
def test_make_policy_starts_at_the_given_version_with_the_rollouts_context(policy) -> None:
    """The first test on the engine (none has pushed weights yet): `make_policy`'s one context rule."""
    assert isinstance(policy, VLLMPolicy) and policy.in_process
    assert policy.engine_kwargs["max_model_len"] == 1024  # the rollout's max_total_tokens
    (gen,) = gather(policy, SamplingConfig(temperature=0.0, max_tokens=2), prompts=PROMPTS[:1])
    assert policy.version == gen.policy_version == gen.policy_version_end == START_VERSION


@pytest.mark.vllm
def test_greedy_matches_transformers(policy, tiny_model_dir: Path) -> None:
    assert isinstance(policy, Policy)
    greedy = SamplingConfig(temperature=0.0, max_tokens=10)
    gens = gather(policy, greedy)
    hf = HFPolicy(tiny_model_dir)
    for prompt, gen in zip(PROMPTS, gens, strict=True):
        assert gen.stop_reason == "length" and len(gen.token_ids) == 10
        assert gen.token_ids == hf.generate_sync(prompt, greedy).token_ids
        assert max_diff(hf.model, prompt, gen, 1.0) < TOL


@pytest.mark.vllm
def test_sampled_logprobs_are_the_sampling_distribution(policy, tiny_model_dir: Path) -> None:
    hf = HFPolicy(tiny_model_dir)
    sampling = SamplingConfig(temperature=0.7, max_tokens=12, seed=11)
    gens = gather(policy, sampling)
    again = gather(policy, sampling)
    assert [g.token_ids for g in gens] == [g.token_ids for g in again]  # per-request seeds reproduce
    for prompt, gen in zip(PROMPTS, gens, strict=True):
        # log_softmax(logits / T) at the sampled ids: the trainer's old log-probs at the rollout temperature.
        assert max_diff(hf.model, prompt, gen, 0.7) < TOL
    # top-p renormalises over the nucleus (vLLM's processed log-probs); the reference does the same.
    import torch

    from agentrl.rollout.hf_policy import _processed_logprobs

    nucleus = SamplingConfig(temperature=1.0, top_p=0.5, max_tokens=6, seed=3)
    gen = gather(policy, nucleus, [PROMPTS[0]])[0]
    ids = torch.tensor([PROMPTS[0] + gen.token_ids])  # [1, T]
    with torch.no_grad():
        logits = hf.model(ids).logits[0, len(PROMPTS[0]) - 1 : -1]  # [G, V]
    ref = _processed_logprobs(logits, 1.0, 0.5).gather(1, ids[0, len(PROMPTS[0]) :, None])[:, 0]  # [G]
    assert max(abs(a - b) for a, b in zip(ref.tolist(), gen.logprobs, strict=True)) < TOL


@pytest.mark.vllm
def test_stop_token_is_kept_and_ends_the_turn(policy) -> None:
    first = gather(policy, SamplingConfig(temperature=0.0, max_tokens=3), [PROMPTS[0]])[0].token_ids[0]
    gen = gather(policy, SamplingConfig(temperature=0.0, max_tokens=8, stop_token_ids=[first]), [PROMPTS[0]])[
        0
    ]
    assert gen.stop_reason == "stop" and gen.token_ids == [first] and len(gen.logprobs) == 1


@pytest.mark.vllm
def test_a_result_for_a_caller_whose_event_loop_closed_is_dropped(policy) -> None:
    """Ctrl-C closes the rollout's event loop while a request is in flight: the engine thread must
    drop that result and keep serving (and later shut down cleanly), not die on 'Event loop is closed'."""
    from vllm.inputs import TokensPrompt

    gone = asyncio.new_event_loop()
    fut = gone.create_future()
    gone.close()
    greedy = SamplingConfig(temperature=0.0, max_tokens=4)
    prompt = TokensPrompt(prompt_token_ids=PROMPTS[0])
    policy._commands.put(("add", "orphan", prompt, policy.sampling_params(greedy), gone, fut))

    async def after() -> int:  # bounded: a dead engine thread would leave it waiting forever
        return len((await asyncio.wait_for(policy.generate(PROMPTS[1], greedy), 120)).token_ids)

    assert asyncio.run(after()) == 4  # served after the orphan finished
    assert policy._thread.is_alive() and not fut.done()


@pytest.mark.vllm
def test_update_weights_reaches_the_engine(policy, tiny_model_dir: Path, other_model_dir: Path) -> None:
    greedy = SamplingConfig(temperature=0.0, max_tokens=8)
    before = gather(policy, greedy)
    v0 = policy.version
    assert policy.update_weights(load_file(other_model_dir / "model.safetensors")) == v0 + 1
    assert policy.version == v0 + 1
    after = gather(policy, greedy)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    other = HFPolicy(other_model_dir)
    for prompt, gen in zip(PROMPTS, after, strict=True):
        assert gen.policy_version == v0 + 1
        assert gen.token_ids == other.generate_sync(prompt, greedy).token_ids
        assert max_diff(other.model, prompt, gen, 1.0) < TOL
    # Back to the first weights, as (name, tensor) pairs this time, numbered by the caller.
    first = iter(load_file(Path(tiny_model_dir) / "model.safetensors").items())
    assert policy.update_weights(first, version=v0 + 7) == v0 + 7
    again = gather(policy, greedy)
    assert [g.token_ids for g in again] == [g.token_ids for g in before]
    assert policy.version == v0 + 7 and {g.policy_version for g in again} == {v0 + 7}


def test_hf_policy_reference(tiny_model_dir: Path, other_model_dir: Path) -> None:
    hf = HFPolicy(tiny_model_dir)
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, seed=5)
    gen = hf.generate_sync(PROMPTS[0], sampling)
    assert gen == hf.generate_sync(PROMPTS[0], sampling)
    assert max_diff(hf.model, PROMPTS[0], gen, 1.0) < 1e-5
    assert hf.update_weights(load_file(other_model_dir / "model.safetensors")) == 1
    assert gen.token_ids != hf.generate_sync(PROMPTS[0], sampling).token_ids or hf.version == 1
    resumed = HFPolicy(tiny_model_dir, version=5)
    assert resumed.generate_sync(PROMPTS[0], sampling).policy_version == 5
    assert resumed.update_weights(load_file(other_model_dir / "model.safetensors")) == 6
    assert (
        resumed.update_weights(load_file(tiny_model_dir / "model.safetensors"), version=9)
        == resumed.version
        == 9
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_async_engine_in_its_own_process_takes_weight_updates(
    tiny_model_dir: Path, other_model_dir: Path
) -> None:
    """The production set-up (AsyncLLM, the engine core in another process): buckets travel as safetensors.
    On the CPU the model runs in the engine core's process: no worker process of its own, which the
    core would reach through a shared-memory queue it waits on by spinning (most of a core here)."""
    with VLLMPolicy(
        tiny_model_dir, dtype="float32", max_model_len=1024, weight_bucket_bytes=1 << 20
    ) as policy:
        engine_procs = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")]
        assert [p.name() for p in engine_procs] == ["VLLM::EngineCore"], engine_procs
        assert not engine_procs[0].children(recursive=True)
        greedy = SamplingConfig(temperature=0.0, max_tokens=6)
        gen = gather(policy, greedy, [PROMPTS[0]])[0]
        assert max_diff(tiny_model_dir, PROMPTS[0], gen, 1.0) < TOL
        policy.update_weights(load_file(other_model_dir / "model.safetensors"))  # several 1 MiB buckets
        gen = gather(policy, greedy, [PROMPTS[0]])[0]
        assert gen.policy_version == 1
        assert gen.token_ids == HFPolicy(other_model_dir).generate_sync(PROMPTS[0], greedy).token_ids
        assert max_diff(other_model_dir, PROMPTS[0], gen, 1.0) < TOL


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("in_process", [False, True], ids=["engine-process", "in-process"])
def test_a_push_reaches_requests_in_flight_between_decode_steps(
    in_process: bool, tiny_model_dir: Path, other_model_dir: Path
) -> None:
    """In-flight weight updates, with the engine core in its own process and in this one: pushes land
    while long generations run (the scheduler is paused around the update, so no step sees half-loaded
    layers), every request finishes, and a generation that straddles a push reports both versions; each
    of its tokens carries the version and the log-prob of the weights it was sampled with: the old
    model's up to the push, the new one's (its context recomputed) after it."""
    import threading

    with VLLMPolicy(
        tiny_model_dir,
        dtype="float32",
        max_model_len=1024,
        weight_bucket_bytes=1 << 20,
        in_process=in_process,
    ) as policy:
        sampling = SamplingConfig(temperature=1.0, max_tokens=300, seed=7)
        new = load_file(other_model_dir / "model.safetensors")
        started = threading.Event()

        def push() -> None:
            started.wait(60)
            time.sleep(1.5)  # decode steps under the first weights (300 tokens take ~5 s here)
            policy.update_weights(new)

        pusher = threading.Thread(target=push)
        pusher.start()

        async def run():
            tasks = [asyncio.create_task(policy.generate(p, sampling)) for p in PROMPTS * 4]
            started.set()
            return await asyncio.gather(*tasks)

        gens = asyncio.run(run())
        pusher.join()
        assert policy.version == 1
        straddling = [
            (p, g) for p, g in zip(PROMPTS * 4, gens, strict=True) if g.policy_version != g.policy_version_end
        ]
        assert straddling, [(g.policy_version, g.policy_version_end, len(g.token_ids)) for g in gens]
        switches = []
        for prompt, gen in straddling:
            # The version a request was submitted under, and the newest when it ended.
            assert (gen.policy_version, gen.policy_version_end) == (0, 1)
            ids = prompt + gen.token_ids
            old = score_logprobs(tiny_model_dir, ids)[len(prompt) :]
            fresh = score_logprobs(other_model_dir, ids)[len(prompt) :]
            by_old = [abs(a - b) < TOL for a, b in zip(old, gen.logprobs, strict=True)]
            by_new = [abs(a - b) < TOL for a, b in zip(fresh, gen.logprobs, strict=True)]
            switch = next(i for i, ok in enumerate(by_old) if not ok)  # the first token of the new weights
            assert all(by_new[switch:]), (switch, by_new)
            # The versions the engine reported switch exactly there.
            assert gen.versions() == [0] * switch + [1] * (len(gen.token_ids) - switch), (switch, gen.versions())
            switches.append(switch)
        assert any(0 < s < sampling.max_tokens for s in switches), switches  # a push mid-way through one


def test_checkpoint_dtype_reads_config_and_defaults_to_float32(tmp_path) -> None:
    # On CPU the policy passes this to vLLM instead of "auto" (which would mean bfloat16 there).
    from agentrl.rollout.policy import checkpoint_dtype

    (tmp_path / "config.json").write_text('{"dtype": "bfloat16"}')
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text('{"torch_dtype": "torch.float16"}')
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_dtype(tmp_path) == "float32"
    assert checkpoint_dtype(tmp_path / "missing") == "float32"


@pytest.mark.vllm
def test_a_weight_push_does_not_report_failed_loads_for_layers_with_nothing_to_load(
    policy, tiny_model_dir: Path
) -> None:
    """vLLM's layer-wise reload warns "RotaryEmbedding: Failed to load weights" on every push (its only
    tensor is a computed, non-persistent buffer, in no checkpoint, which the reload restores), and
    "ParallelLMHead: ..." for a head tied to the embedding: those records are dropped; the layers are
    found by their structure, not by name."""
    import logging

    from agentrl.rollout.weight_sync import _ExpectedReloadWarnings

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    handler = Keep(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        policy.update_weights(load_file(Path(tiny_model_dir) / "model.safetensors"))
    finally:
        logger.removeHandler(handler)
    (quiet,) = [f for f in logger.filters if isinstance(f, _ExpectedReloadWarnings)]
    assert "RotaryEmbedding" in quiet.layer_classes
    assert "ParallelLMHead" in quiet.layer_classes  # the tiny model ties its head to the embedding
    assert "VocabParallelEmbedding" not in quiet.layer_classes  # the layer the checkpoint does load
    assert not [r for r in records if "Failed to load weights" in r.getMessage()]
    # A layer with parameters that loaded nothing still warns.
    real = logging.LogRecord(
        logger.name, logging.WARNING, "", 0, "%s: Failed to load weights", ("QKVParallelLinear",), None
    )
    assert quiet.filter(real)
