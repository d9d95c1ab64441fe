"""The rollout engine: real vLLM on calc-v0 through docker, and the failure paths, one episode each.

The tiny model is a random initialisation: it writes no tool calls, so calc-v0 answers every turn
with an error observation and the episode runs to its turn limit. That is still a real multi-turn
trajectory (sampled turns, tool/error observations, glue), produced by the real vLLM policy, which
is what the token bookkeeping is checked on. Tests of the failure paths need an agent that calls
tools on purpose; they use `ScriptedPolicy`, a test double that writes fixed actions.

Log-prob tolerance: vLLM's behaviour log-probs must match a transformers forward pass over the
same ids within 1e-4 (float32 on CPU; measured about 1e-6).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentrl.core.task import Task
from agentrl.envs.calc import CalcEnv
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.loop import collect, collect_sync
from agentrl.rollout.masker import ChatMasker
from agentrl.rollout.policy import Generation, SamplingConfig, VLLMPolicy
from agentrl.rollout.trajectory import Trajectory, load_trajectories, save_trajectories
from tests import fixtures_model
from tests.rollout.score import score_logprobs

tiny_model_dir = fixtures_model.tiny_model_dir  # the session-wide tiny model, as a fixture of this module

LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path):
    # In-process engine: one process, about 10 s to start here instead of about a minute.
    p = VLLMPolicy(tiny_model_dir, in_process=True, dtype="float32", max_model_len=2048, cpu_threads=1)
    yield p
    p.close()


class RecordingPolicy:
    """Wraps the real policy and records every (prompt ids, generation) it returned."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: dict[tuple[int, ...], list[Generation]] = {}

    @property
    def version(self) -> int:
        return self.inner.version

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        gen = await self.inner.generate(prompt_ids, sampling)
        self.calls.setdefault(tuple(prompt_ids), []).append(gen)
        return gen

    def generation_for(self, prompt_ids: list[int], sampled: list[int]) -> Generation:
        """The generation returned for exactly this prompt whose ids are `sampled` (group members share a prompt)."""
        matches = [g for g in self.calls.get(tuple(prompt_ids), []) if g.token_ids == sampled]
        assert matches, "the trajectory holds sampled ids the policy never returned for that context"
        return matches[0]


class ScriptedPolicy:
    """Test double for the engine's bookkeeping only: writes `script(conversation text)` as canonical ids."""

    def __init__(self, tokenizer, script: Callable[[str], str]):
        self.masker = ChatMasker(tokenizer)
        self.script = script
        self.version = 0

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        await asyncio.sleep(0)
        ids = self.masker.encode(self.script(self.masker.decode(prompt_ids)))
        ids = ([*ids, self.masker.end_of_turn_id])[: sampling.max_tokens]
        reason = "stop" if ids[-1] == self.masker.end_of_turn_id else "length"
        return Generation(ids, [-0.5] * len(ids), reason, self.version, self.version)


def mask_runs(t: Trajectory, value: int) -> list[tuple[int, list[int]]]:
    """(start index, ids) of each maximal run of ids whose mask is `value`."""
    out: list[tuple[int, list[int]]] = []
    for i, (tok, m) in enumerate(zip(t.token_ids, t.loss_mask, strict=True)):
        if m == value:
            if i == 0 or t.loss_mask[i - 1] != value:
                out.append((i, []))
            out[-1][1].append(tok)
    return out


def split_turns(messages: list[dict]) -> tuple[list[dict], list[tuple[dict, list[dict]]]]:
    """The env's record -> (first messages, [(assistant message, observation messages after it)])."""
    first_asst = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    turns: list[tuple[dict, list[dict]]] = []
    for m in messages[first_asst:]:
        if m["role"] == "assistant":
            turns.append((m, []))
        else:
            turns[-1][1].append(m)
    return messages[:first_asst], turns


@pytest.mark.vllm
@pytest.mark.docker
def test_real_vllm_calc_trajectories_are_exact(
    policy,
    tokenizer,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    rec = RecordingPolicy(policy)
    cfg = RolloutConfig(
        group_size=2, max_tokens_per_turn=12, max_total_tokens=1536, concurrency=4, temperature=1.0
    )
    tasks = [CalcEnv().tasks.get(i) for i in range(2)]
    trajs = collect_sync("agentrl/calc-v0", tasks, rec, cfg, seed=7, tokenizer=tokenizer)
    assert len(trajs) == 4
    assert [t.task_id for t in trajs] == [tasks[0].id] * 2 + [tasks[1].id] * 2
    assert trajs[0].group_id == trajs[1].group_id != trajs[2].group_id == trajs[3].group_id
    # Two samples of the same task differ (different per-episode seeds).
    assert trajs[0].token_ids != trajs[1].token_ids

    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    dec = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    for t in trajs:
        assert t.finish_reason in {"max_turns", "max_tokens", "submitted"}, (t.finish_reason, t.error)
        assert t.trainable and t.policy_version == t.policy_version_max == 0
        assert t.turns >= 2  # multi-turn: the env answered and the policy went on
        sampled = mask_runs(t, 1)
        forced = mask_runs(t, 0)
        assert len(sampled) == t.turns

        # Mask 1 = exactly what the policy produced: each run is the generation for the ids before it.
        gens = [rec.generation_for(t.token_ids[:start], ids) for start, ids in sampled]
        assert dec([i for _, ids in sampled for i in ids]) == "".join(dec(g.token_ids) for g in gens)
        # ... with the log-probs it reported, and those match a transformers forward over the same ids.
        for (start, ids), g in zip(sampled, gens, strict=True):
            assert t.behavior_logprobs[start : start + len(ids)] == g.logprobs
        ref = score_logprobs(tiny_model_dir, t.token_ids, temperature=cfg.temperature)
        diffs = [abs(a - b) for a, b, m in zip(ref, t.behavior_logprobs, t.loss_mask, strict=True) if m]
        assert max(diffs) < LOGPROB_TOLERANCE, max(diffs)

        # Mask 0 = exactly the prompt, then per turn: template glue + the env's observations + generation prompt.
        first, turns = split_turns(t.messages)
        assert forced[0] == (
            0,
            enc(tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)),
        )
        assert t.prompt_len == len(forced[0][1])
        convo = list(first)
        for k, (_, ids) in enumerate(forced[1:]):
            asst, obs = turns[k]
            assert asst["content"] == dec(
                gens[k].token_ids[:-1] if gens[k].stop_reason == "stop" else gens[k].token_ids
            )
            before = tokenizer.apply_chat_template([*convo, asst], tokenize=False)
            after = tokenizer.apply_chat_template(
                [*convo, asst, *obs], tokenize=False, add_generation_prompt=True
            )
            glue = "\n" if gens[k].stop_reason == "stop" else "<|im_end|>\n"
            assert after.startswith(before)
            assert dec(ids) == glue + after[len(before) :]
            convo += [asst, *obs]
        # The tiny template is append-only: a full re-render gives the same text; ids can differ only
        # where the random policy sampled a non-canonical tokenization, and that is reported, not fixed.
        assert t.drift is not None
        assert not t.drift.drifted or t.drift.kind == "tokenization", t.drift.detail
        assert t.timings.generate_s > 0 and t.timings.total_s >= t.timings.generate_s

    path = tmp_path / "t.jsonl"
    save_trajectories(path, trajs)
    assert load_trajectories(path) == trajs


def _guess_script(text: str) -> str:
    """Binary search from the conversation so far (guess-number-v0)."""
    high = int(re.search(r"between 1 and (\d+)", text).group(1))
    low = 1
    guesses = [int(g) for g in re.findall(r'"number": (\d+)\}', text)]
    feedback = re.findall(r"<tool_response>\n(higher|lower)", text)
    for g, f in zip(guesses, feedback, strict=False):
        low, high = (g + 1, high) if f == "higher" else (low, g - 1)
    return f'<tool_call>\n{{"name": "guess", "arguments": {{"number": {(low + high) // 2}}}}}\n</tool_call>'


def test_scripted_multi_turn_bookkeeping_and_budget(tokenizer) -> None:
    """guess-number-v0 (no sandbox): a binary-search script solves every task over many turns, drift-free."""
    pol = ScriptedPolicy(tokenizer, _guess_script)
    trajs = collect_sync(
        "agentrl/guess-number-v0",
        [0, 1, 2],
        pol,
        RolloutConfig(group_size=2, max_tokens_per_turn=64, concurrency=3),
        tokenizer=tokenizer,
    )
    assert len(trajs) == 6 and all(t.finish_reason == "submitted" and t.passed for t in trajs), [
        (t.finish_reason, t.error) for t in trajs
    ]
    assert any(t.turns >= 4 for t in trajs)
    assert all(t.drift is not None and not t.drift.drifted for t in trajs)
    assert len({t.group_id for t in trajs}) == 3

    # A context budget smaller than the episode needs: it ends `max_tokens`, never longer than the budget.
    budget = len(trajs[0].token_ids) - 5
    short = collect_sync(
        "agentrl/guess-number-v0",
        [0],
        pol,
        RolloutConfig(group_size=1, max_tokens_per_turn=64, max_total_tokens=budget),
        tokenizer=tokenizer,
    )[0]
    assert short.finish_reason == "max_tokens" and len(short.token_ids) <= budget
    assert short.trainable and short.reward == 0.0


class FaultyCalcEnv(CalcEnv):
    """calc-v0 in docker, with faults keyed by task id: `crash` raises in step, `die` loses its container."""

    def step(self, action: str):
        if self.task.id == "crash" and self.episode.turns >= 1:
            raise RuntimeError("simulated environment crash in step")
        if self.task.id == "die":
            import docker

            docker.from_env().containers.get(self.sandbox.id).remove(force=True)
        return super().step(action)


def _calc_script(text: str) -> str:
    if "<tool_response>" not in text:
        if "HANG" in text:  # a tool that sleeps far beyond the episode's wall-clock limit
            return '<tool_call>\n{"name": "python", "arguments": {"code": "import time; time.sleep(120)"}}\n</tool_call>'
        expr = re.search(r"EXPR\[(.+?)\]", text).group(1)
        return f'<tool_call>\n{{"name": "python", "arguments": {{"code": "print({expr})"}}}}\n</tool_call>'
    out = re.findall(r"<tool_response>\n(-?\d+)", text)
    return f'<tool_call>\n{{"name": "submit", "arguments": {{"answer": "{out[-1] if out else 0}"}}}}\n</tool_call>'


@pytest.mark.docker
def test_hang_crash_and_dead_sandbox_each_end_one_episode(tokenizer) -> None:
    def task(tid: str, expr: str, tag: str = "") -> Task:
        return Task(
            id=tid,
            prompt=f"{tag}Compute EXPR[{expr}].",
            answer=str(eval(expr)),
            metadata={"expression": expr},
        )

    tasks = [
        task("ok-1", "6 * 7"),
        task("hang", "1 + 1", "HANG "),
        task("crash", "2 + 3"),
        task("die", "3 + 4"),
        task("ok-2", "12 - 5"),
    ]
    timeout_s = 12.0
    t0 = time.perf_counter()
    trajs = collect_sync(
        lambda: FaultyCalcEnv(exec_timeout_s=300.0),
        tasks,
        ScriptedPolicy(tokenizer, _calc_script),
        RolloutConfig(group_size=1, max_tokens_per_turn=96, episode_timeout_s=timeout_s, concurrency=5),
        tokenizer=tokenizer,
    )
    wall = time.perf_counter() - t0
    by_id = {t.task_id: t for t in trajs}
    assert set(by_id) == {"ok-1", "hang", "crash", "die", "ok-2"}
    for tid in ("ok-1", "ok-2"):
        assert by_id[tid].finish_reason == "submitted" and by_id[tid].passed, (
            by_id[tid].verdict_details,
            by_id[tid].messages,
        )
    hang, crash, die = by_id["hang"], by_id["crash"], by_id["die"]
    assert hang.finish_reason == "timeout" and "wall-clock" in hang.error
    assert crash.finish_reason == "env_error" and "simulated environment crash" in crash.error
    assert die.finish_reason == "env_error" and "sandbox" in (die.error or "")
    assert not hang.trainable and not crash.trainable and not die.trainable
    # The episodes that failed keep what they had: the prompt and the sampled first turn.
    assert crash.turns == 1 and sum(crash.loss_mask) > 0
    # Nobody waited for the sleeping tool (120 s): the batch ended soon after the episode timeout.
    assert wall < timeout_s + 60


@pytest.mark.docker  # CalcEnv's python tool runs in a Docker sandbox
def test_reset_failure_is_an_env_error_for_that_episode_only(tokenizer) -> None:
    class BrokenReset(CalcEnv):
        def reset(self, *, seed=None, options=None):
            if options and options["task"].id == "bad":
                raise RuntimeError("task set-up failed")
            return super().reset(seed=seed, options=options)

    tasks = [
        Task(id="bad", prompt="Compute 1 + 1.", answer="2"),
        Task(id="good", prompt="Compute 2 + 2.", answer="4"),
    ]
    script = lambda text: '<tool_call>\n{"name": "submit", "arguments": {"answer": "4"}}\n</tool_call>'  # noqa: E731
    trajs = asyncio.run(
        collect(
            lambda: BrokenReset(require_python=False),
            tasks,
            ScriptedPolicy(tokenizer, script),
            RolloutConfig(group_size=1),
            tokenizer=tokenizer,
        )
    )
    bad, good = trajs
    assert bad.finish_reason == "env_error" and "task set-up failed" in bad.error and bad.token_ids == []
    assert good.finish_reason == "submitted" and good.passed


@pytest.mark.vllm
@pytest.mark.slow
def test_rollout_cli_writes_trajectories(tiny_model_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "rollout.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl.cli",
            "rollout",
            "--env",
            "agentrl/guess-number-v0",
            "--model",
            str(tiny_model_dir),
            "--n",
            "2",
            "--group-size",
            "2",
            "--max-tokens-per-turn",
            "8",
            "--max-total-tokens",
            "1024",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    trajs = load_trajectories(out)
    assert len(trajs) == 4 and len({t.group_id for t in trajs}) == 2
    assert all(sum(t.loss_mask) > 0 and t.turns >= 1 for t in trajs)
    assert "4 trajectories" in proc.stdout and "mean_reward" in proc.stderr  # summary line, progress bar


def test_group_sizes_give_each_task_its_own_number_of_episodes(tokenizer) -> None:
    pol = ScriptedPolicy(tokenizer, _guess_script)
    cfg = RolloutConfig(group_size=4, max_tokens_per_turn=64, concurrency=4)
    trajs = collect_sync("agentrl/guess-number-v0", [0, 1], pol, cfg, tokenizer=tokenizer, group_sizes=[1, 3])
    sizes = Counter(t.group_id for t in trajs)
    assert sorted(sizes.values()) == [1, 3] and len(trajs) == 4
    with pytest.raises(ValueError, match="group_sizes must give a positive size for each of the 2 tasks"):
        collect_sync("agentrl/guess-number-v0", [0, 1], pol, cfg, tokenizer=tokenizer, group_sizes=[2])


def test_calls_on_several_threads_share_the_episode_permits(tokenizer) -> None:
    """`slots`: collect calls running at once on different threads (overlapping training batches) hold
    one permit per episode, so together they never play more episodes than the permits allow."""

    class Counting(ScriptedPolicy):
        lock = threading.Lock()
        now = peak = 0

        async def generate(self, prompt_ids, sampling):
            with Counting.lock:
                Counting.now += 1
                Counting.peak = max(Counting.peak, Counting.now)
            try:
                await asyncio.sleep(0.02)
                return await super().generate(prompt_ids, sampling)
            finally:
                with Counting.lock:
                    Counting.now -= 1

    cfg = RolloutConfig(group_size=2, max_tokens_per_turn=64, concurrency=8)
    slots = threading.Semaphore(3)
    results: list[list[Trajectory]] = []

    def call() -> None:
        pol = Counting(tokenizer, _guess_script)
        results.append(
            collect_sync("agentrl/guess-number-v0", [0, 1, 2, 3], pol, cfg, tokenizer=tokenizer, slots=slots)
        )

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(r) for r in results] == [8, 8]
    assert 2 <= Counting.peak <= 3  # 16 episodes asked for at once, 3 permits


class Pushed(ScriptedPolicy):
    """Reports a weight push in the middle of its second generation (as the engine does, in
    `Generation.token_versions`), or, with `every`, a push in every generation after the first."""

    def __init__(self, tokenizer, script, every: bool = False):
        super().__init__(tokenizer, script)
        self.calls, self.every = 0, every

    async def generate(self, prompt_ids, sampling):
        gen = await super().generate(prompt_ids, sampling)
        self.calls += 1
        n, k = len(gen.token_ids), self.calls
        if k == 1 or (not self.every and k > 2):  # no push during this one
            versions = [0 if k == 1 else 1] * n
        else:  # a push halfway through: from the version before it to the one after
            before = k - 2 if self.every else 0
            versions = [before] * (n // 2) + [before + 1] * (n - n // 2)
        self.version = versions[-1]
        return dataclasses.replace(
            gen, policy_version=versions[0], policy_version_end=versions[-1], token_versions=tuple(versions)
        )


def test_each_sampled_token_keeps_the_version_it_was_sampled_with(tokenizer) -> None:
    """A push in the middle of turn 2: the trajectory's ids of turn 1 are version 0, turn 2 switches where
    the push landed, later turns are version 1; ids the policy did not sample (prompt, observations) are -1."""
    pol = Pushed(tokenizer, _guess_script)
    [t] = collect_sync(
        "agentrl/guess-number-v0",
        [0],
        pol,
        RolloutConfig(group_size=1, max_tokens_per_turn=64),
        tokenizer=tokenizer,
    )
    assert t.turns >= 3 and len(t.token_versions) == len(t.token_ids)
    assert all(v == -1 for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m == 0)
    turns = [[t.token_versions[i] for i in range(start, start + len(ids))] for start, ids in mask_runs(t, 1)]
    n2 = len(turns[1])
    assert turns[0] == [0] * len(turns[0]) and turns[1] == [0] * (n2 // 2) + [1] * (n2 - n2 // 2)
    assert all(v == 1 for turn in turns[2:] for v in turn)
    assert (t.policy_version, t.policy_version_max) == (0, 1)


def test_on_push_restart_plays_the_episode_again_under_one_version(tokenizer) -> None:
    """`on_push: restart`: the episode the push reached mid-turn is abandoned and played again from reset;
    every token of what is trained comes from the new weights. Pushes without end: restarted
    `max_restarts` times, then it goes on (never a live-lock)."""
    cfg = RolloutConfig(group_size=1, max_tokens_per_turn=64, on_push="restart")
    [t] = collect_sync(
        "agentrl/guess-number-v0", [0], Pushed(tokenizer, _guess_script), cfg, tokenizer=tokenizer
    )
    assert t.restarts == 1 and t.finish_reason == "submitted" and t.passed
    assert {v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m} == {1}
    assert (t.policy_version, t.policy_version_max) == (1, 1)

    always = Pushed(tokenizer, _guess_script, every=True)
    [t] = collect_sync("agentrl/guess-number-v0", [0], always, cfg, tokenizer=tokenizer)
    assert t.restarts == cfg.max_restarts and t.finish_reason == "submitted"
    assert t.policy_version < t.policy_version_max  # the last attempt straddled pushes, and says so
