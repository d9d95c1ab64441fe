"""The README's and the guides' snippets run as written: the user's first page must not lie.

Every ```python block of README.md and docs/*.md is executed by one test here (the first test makes
sure none is left out): the environment snippet against real Docker sandboxes, the third-party
environment and verifier modules as an importable package beside the README's task line, the
guides' settings model, scripted oracle and attack plugin. The other blocks are checked for what
they are: every ```toml entry point resolves to the snippet it names, every ```yaml block is a valid
training config, every `agentrl ...` line of a ```bash block parses against the CLI (the tour's
check commands run for real), and every `make ...` line names a Makefile target.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

import agentrl
from agentrl.env.registry import registry
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(language: str) -> list[tuple[str, str]]:
    """(page, text) of every fenced block of `language` in the README and the guides."""
    found = []
    for page in PAGES:
        for lang, text in _FENCE.findall(page.read_text()):
            if lang == language:
                found.append((page.relative_to(ROOT).as_posix(), text))
    return found


def block(marker: str) -> str:
    """The one ```python block holding `marker`."""
    (found,) = [text for _, text in blocks("python") if marker in text]
    return found


# Each ```python block holds exactly one of these; the test named beside it runs the block.
PYTHON_BLOCKS = {
    'agentrl.make("agentrl/calc-v0")': "test_environment_snippet",
    "# mylab/envs.py": "test_your_own_environment_snippet",
    "# mylab/verifiers.py": "test_verifier_snippet",
    "# mylab/agents.py": "test_agent_snippet",
    '"mylab/repair-mini-v0"': "test_agent_in_the_sandbox_snippet",
    "# mylab/samplers.py": "test_sampler_snippet",
    "class MazeSettings": "test_settings_model_snippet",
    "class ComputeThenSubmit": "test_scripted_oracle_snippet",
    "class LeakTheAnswerFile": "test_attack_plugin_snippet",
    "# mylab/wordbot.py": "test_own_agent_warm_start_snippet",
    "# mylab/service.py": "test_agent_service_snippet",
    "mcp-server-sqlite": "test_mcp_tools_snippet",
    'get(\n    "judge",': "test_judged_reward_snippet",
    "register_task_set(": "test_harbor_task_set_snippet",
    "register_instances(": "test_swebench_instances_snippet",
    "# mylab/sandboxes.py": "test_sandbox_backend_snippet",
    "# the GRPO loss by hand": "test_loss_snippet",
}


def test_every_python_block_is_run_here():
    for page, text in blocks("python"):
        held = [m for m in PYTHON_BLOCKS if m in text]
        assert len(held) == 1, (
            f"a ```python block of {page} is run by no test here (or by two): {text[:200]!r}"
        )
    for marker, test in PYTHON_BLOCKS.items():
        assert len([t for _, t in blocks("python") if marker in t]) == 1, f"{test}: no block holds {marker!r}"
        assert test in globals(), test


@pytest.mark.docker
def test_harbor_task_set_snippet():
    namespace: dict = {}
    exec(compile(block("register_task_set("), "docs/ENVIRONMENTS.md", "exec"), namespace)
    assert namespace["reward"] == 1.0


@pytest.mark.docker
def test_swebench_instances_snippet(tmp_path, monkeypatch):
    from agentrl.envs.harbor.export import export_swebench
    from tests.envs.test_harbor import _repair_like_task

    # A test-split instance, as SWE-bench's are: the snippet plays the test split.
    task = _repair_like_task(tmp_path).model_copy(update={"split": "test"})
    export_swebench([task], tmp_path / "swe")  # swe/instances.jsonl + swe/images/
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block("register_instances("), "docs/ENVIRONMENTS.md", "exec"), namespace)
    assert namespace["reward"] == 1.0


@pytest.mark.docker
def test_environment_snippet():
    namespace: dict = {}
    exec(compile(block('agentrl.make("agentrl/calc-v0")'), "README.md", "exec"), namespace)
    obs = namespace["obs"]
    assert obs[0]["role"] == "tool" and obs[0]["content"].strip() == "42"  # print(6*7) ran in the sandbox


# --- the README's mylab package: envs.py, verifiers.py, tasks.jsonl; the guides' attacks.py ----------

README_TASK_LINE = next(text for page, text in blocks("jsonl") if page == "README.md")
# More rows of the README's shape, so that the tour's `--tasks 5` checks have five tasks to play.
MORE_TASKS = [("Japan", "Tokyo"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Norway", "Oslo")]


@pytest.fixture
def mylab(tmp_path, monkeypatch):
    """The README's `mylab` package on sys.path: its modules and a tasks.jsonl led by the README's line."""
    package = tmp_path / "mylab"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "envs.py").write_text(block("# mylab/envs.py"))
    (package / "verifiers.py").write_text(block("# mylab/verifiers.py"))
    (package / "attacks.py").write_text(block("class LeakTheAnswerFile"))
    (package / "samplers.py").write_text(block("# mylab/samplers.py"))
    (package / "sandboxes.py").write_text(block("# mylab/sandboxes.py"))
    rows = [json.loads(line) for line in README_TASK_LINE.splitlines() if line.strip()]
    for i, (country, capital) in enumerate(MORE_TASKS, start=len(rows)):
        rows.append(
            {
                "id": f"lookup/{i}",
                "prompt": f"What is the capital of {country}? Look it up.",
                "answer": capital,
                "metadata": {
                    "table": {country: capital},
                    "oracle_calls": [{"name": "lookup", "arguments": {"key": country}}],
                },
            }
        )
    (package / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.syspath_prepend(str(tmp_path))
    from mylab.envs import register_envs  # type: ignore[import-not-found]

    register_envs()
    yield package
    registry.pop("mylab/Lookup-v0", None)
    for env_id in ("mylab/Lookup-agent-v0", "mylab/Pick-v0", "mylab/WordBot-v0", "mylab/Lookup-svc-v0"):
        registry.pop(env_id, None)
    for name in [m for m in sys.modules if m == "mylab" or m.startswith("mylab.")]:
        del sys.modules[name]


class _SubmitAtOnce:
    """Submits `answer` on its first turn, without looking anything up."""

    def __init__(self, env, answer: str):
        self.env, self.answer = env, answer

    def act(self, observation):
        return self.env.parser.render_call("submit", answer=self.answer)


def test_your_own_environment_snippet(mylab):
    assert registry["mylab/Lookup-v0"].description.startswith("Answer a question")  # what `envs list` shows
    env = agentrl.make("mylab/Lookup-v0")
    try:
        task = env.tasks.get(0, "train")
        assert task.metadata["oracle_calls"] == [{"name": "lookup", "arguments": {"key": "France"}}]
        result = agentrl.run_episode(env, env.oracle(task), options={"task": task})
        assert result.verdict.passed and env.episode.tools_used == {"lookup": 1, "submit": 1}
    finally:
        env.close()


def test_verifier_snippet(mylab):
    from mylab.verifiers import LookedUpAnswer  # type: ignore[import-not-found]

    env = agentrl.make("mylab/Lookup-v0", verifier=LookedUpAnswer())
    try:
        task = env.tasks.get(0, "train")
        looked_up = agentrl.run_episode(env, env.oracle(task), options={"task": task})
        assert looked_up.verdict.passed and looked_up.reward == 1.0
        guessed = agentrl.run_episode(env, _SubmitAtOnce(env, "Paris"), options={"task": task})
        assert not guessed.verdict.passed and "without a lookup" in guessed.verdict.details
    finally:
        env.close()


def test_agent_snippet(mylab, tiny_model_dir):  # noqa: F811
    """The README's OpenAI-SDK agent plays the README's environment through a gateway session: its tool
    call runs, its submission is scored, and every trained token is one the policy sampled."""
    from transformers import AutoTokenizer

    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.loop import collect_sync
    from tests.gateway.scripted import RecordingPolicy, ToolCallPolicy, assert_all_sampled

    (mylab / "agents.py").write_text(block("# mylab/agents.py"))
    import mylab.agents  # type: ignore[import-not-found]

    def write(prompt: str, call: int) -> str:  # look France up, then submit what came back
        if call == 0:
            return '<tool_call>\n{"name": "lookup", "arguments": {"key": "France"}}\n</tool_call>'
        return '<tool_call>\n{"name": "submit", "arguments": {"answer": "Paris"}}\n</tool_call>'

    record = RecordingPolicy(ToolCallPolicy(AutoTokenizer.from_pretrained(tiny_model_dir), write))
    (traj,) = collect_sync(
        "mylab/Lookup-agent-v0", [0], record, RolloutConfig(group_size=1, max_tokens_per_turn=64)
    )
    assert traj.finish_reason == "submitted" and traj.reward == 1.0 and traj.tool_calls == 2
    assert traj.branches == 1 and assert_all_sampled(traj, record) == 2


def test_own_agent_warm_start_snippet(mylab, tiny_model_dir):  # noqa: F811
    """docs/AGENTS.md's agent of its own plays the oracle's demonstrations in its own prompt and tool
    schema (the whole path, warm start to pass@k, is `tests/test_userpath.py`'s, from these lines)."""
    from transformers import AutoTokenizer

    from agentrl.kit.demonstrations import generate_demos

    (mylab / "wordbot.py").write_text(block("# mylab/wordbot.py"))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    trajs, stats = generate_demos("mylab.wordbot:mylab/WordBot-v0", 3, mylab / "demos.jsonl", tok)
    assert stats.episodes == stats.passed == 3
    for t in trajs:
        shown = tok.decode(t.token_ids[: t.prompt_len])
        assert "You are WordBot." in shown and "Hand in the word you were asked for." in shown


def test_agent_service_snippet(mylab, tiny_model_dir, monkeypatch):  # noqa: F811
    """docs/AGENTS.md's agent service: the harness env offers an episode, the guide's loop (on a thread
    here; `tests/gateway/test_service.py` runs it as a separate process) plays it, the verifier scores."""
    import socket
    import threading

    from transformers import AutoTokenizer

    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.loop import collect_sync
    from tests.gateway.scripted import ToolCallPolicy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AGENTRL_SERVICE_TOKEN", "docs-secret")
    (mylab / "service.py").write_text(block("# mylab/service.py").replace("8765", str(port)))
    import mylab.service  # type: ignore[import-not-found]

    def write(prompt: str, call: int) -> str:
        if call == 0:
            return '<tool_call>\n{"name": "lookup", "arguments": {"key": "France"}}\n</tool_call>'
        return '<tool_call>\n{"name": "submit", "arguments": {"answer": "Paris"}}\n</tool_call>'

    import httpx  # noqa: F401  (imported once here: the agent's thread and the rollout's racing to import
    # it first left one of them a partially initialized module, under load)

    agent = threading.Thread(target=mylab.service.serve_episodes, kwargs={"idle_s": 5}, daemon=True)
    agent.start()
    policy = ToolCallPolicy(AutoTokenizer.from_pretrained(tiny_model_dir), write)
    (traj,) = collect_sync(
        "mylab/Lookup-svc-v0", [0], policy, RolloutConfig(group_size=1, max_tokens_per_turn=64)
    )
    agent.join(timeout=30)
    assert traj.finish_reason == "submitted" and traj.reward == 1.0 and traj.tool_calls == 2


@pytest.mark.docker
def test_agent_in_the_sandbox_snippet(semver_repair_task, tiny_model_dir):  # noqa: F811
    """docs/AGENTS.md's mini-swe-agent harness, registered as it is there, runs in docker through the gateway:
    its CLI from the harness layer's PATH, its commands in the container, its calls token-exact."""
    from transformers import AutoTokenizer

    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.loop import collect_sync
    from tests.gateway.scripted import RecordingPolicy, ToolCallPolicy, assert_all_sampled
    from tests.gateway.test_command import bash_call

    exec(compile(block('"mylab/repair-mini-v0"'), "docs/AGENTS.md", "exec"), {})
    steps = ["ls", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    record = RecordingPolicy(ToolCallPolicy(tok, lambda _prompt, n: bash_call(steps[min(n, 1)])))
    cfg = RolloutConfig(group_size=1, max_tokens_per_turn=256, max_total_tokens=8192, episode_timeout_s=300)
    (traj,) = collect_sync(
        lambda: agentrl.make("mylab/repair-mini-v0", tasks=[semver_repair_task]), [0], record, cfg
    )
    assert traj.finish_reason == "submitted", traj.error
    assert traj.turns == 2 and traj.reward == 0.0 and traj.verdict_details
    assert traj.branches == 1 and assert_all_sampled(traj, record) == 2


def test_entry_points_resolve_to_the_snippets(mylab):
    import importlib

    groups = {
        "agentrl.envs",
        "agentrl.verifiers",
        "agentrl.attacks",
        "agentrl.samplers",
        "agentrl.sandbox_backends",
    }
    seen = set()
    for page, text in blocks("toml"):
        for group, entries in tomllib.loads(text)["project"]["entry-points"].items():
            assert group in groups, f"{page}: no such entry-point group {group!r}"
            for name, target in entries.items():
                module, _, attr = target.partition(":")
                assert callable(getattr(importlib.import_module(module), attr)), f"{page}: {name} = {target}"
                seen.add(group)
    assert seen == groups


def test_sampler_snippet(mylab):
    """The guide's sampler, named as `curriculum.sampler` names it: new tasks first, then half of each
    draw the tasks that failed most, with the curriculum's bookkeeping (tracking, state) as the band's."""
    from agentrl.train.curriculum import CurriculumConfig, build_curriculum
    from tests.train.test_curriculum import group

    tasks = [agentrl.Task(id=f"t/{i}", prompt=str(i)) for i in range(10)]
    sampler = build_curriculum(tasks, CurriculumConfig(sampler="mylab.samplers:MostFailed"))
    first = sampler.sample(4)
    assert [d.kind for d in first] == ["probe"] * 4
    for d, fails in zip(first, [0, 3, 1, 2], strict=True):
        sampler.update(group(d.task_id, [0.0] * fails + [1.0] * (4 - fails)))
    again = sampler.sample(4)
    assert [d.task_id for d in again[:2]] == [first[1].task_id, first[3].task_id]  # 3 and 2 failures
    assert [d.kind for d in again] == ["revisit", "revisit", "probe", "probe"]
    assert sampler.state_dict()["sampler"] == "MostFailed"


def test_settings_model_snippet():
    from pydantic import ValidationError

    namespace: dict = {}
    exec(compile(block("class MazeSettings"), "docs/ENVIRONMENTS.md", "exec"), namespace)
    settings_model = namespace["MazeSettings"]
    assert settings_model().size == 8 and settings_model().max_turns == 40
    with pytest.raises(ValidationError, match="size"):
        settings_model(size=1)

    class MazeEnv(agentrl.ToolEnv):
        settings_model = namespace["MazeSettings"]

    env = MazeEnv(tasks=[agentrl.Task(id="maze/0", prompt="Leave the maze.")], tools=["submit"], size=12)
    try:
        assert env.settings.size == 12 and env.max_turns == 40
    finally:
        env.close()


def test_scripted_oracle_snippet():
    namespace: dict = {}
    exec(compile(block("class ComputeThenSubmit"), "docs/ENVIRONMENTS.md", "exec"), namespace)
    env = agentrl.make("agentrl/calc-v0", backend="local", use_pool=False)
    try:
        task = agentrl.Task(
            id="calc/0", prompt="Compute 6 * 7.", answer="42", metadata={"expression": "6 * 7"}
        )
        oracle = namespace["ComputeThenSubmit"](task, env.parser)
        result = agentrl.run_episode(env, oracle, options={"task": task})
        assert result.verdict.passed and env.episode.calls_ran("python") == 1
    finally:
        env.close()


def test_attack_plugin_snippet(mylab):
    from mylab.attacks import LeakTheAnswerFile  # type: ignore[import-not-found]

    env = agentrl.make("mylab/Lookup-v0")
    try:
        why_not = LeakTheAnswerFile().applies_to(
            env
        )  # the env has no bash tool: not applicable, and it says why
        assert isinstance(why_not, str) and "bash" in why_not
    finally:
        env.close()


def test_sandbox_backend_snippet(mylab):
    """The guide's backend, registered as its entry point would: opened by name, kept warm by the pool, and
    an environment's tool calls run in it (at priority 19)."""
    import warnings

    from agentrl.sandbox import BACKENDS, backend_capabilities, open_sandbox
    from agentrl.sandbox.pool import PoolKey, SandboxPool

    with BACKENDS.isolated(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*NO isolation.*")
        BACKENDS.register("nice", "mylab.sandboxes:NiceSandbox")
        assert backend_capabilities("nice") == backend_capabilities("local")
        with open_sandbox("nice") as sb:
            assert sb.exec("ps -o ni= -p $$").stdout.strip() == "19"
        with SandboxPool(size=1) as pool:
            sb = pool.acquire_key(PoolKey.make("nice"))
            assert type(sb).__name__ == "NiceSandbox"
            pool.release(sb)
        task = agentrl.Task(id="nice/0", prompt="How nice?", answer="19")
        with agentrl.ToolEnv(
            tasks=[task], tools=["bash", "submit"], verifier="exact-match", backend="nice", use_pool=False
        ) as env:
            env.reset(options={"task": task})
            obs, *_ = env.step(
                '<tool_call>\n{"name": "bash", "arguments": {"command": "ps -o ni= -p $$"}}\n</tool_call>'
            )
            assert obs[0]["content"].strip() == "19"


def test_loss_snippet():
    exec(compile(block("# the GRPO loss by hand"), "docs/EXTENDING.md", "exec"), {})


# --- commands and configs ------------------------------------------------------------------------------


def command_lines(program: str) -> list[tuple[str, list[str]]]:
    """(page, argv) of every `program ...` line of the ```bash blocks, continuation lines joined."""
    found = []
    for page, text in blocks("bash"):
        for line in text.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] == program:
                found.append((page, argv[1:]))
    return found


def parse_cli(argv: list[str]) -> list[str]:
    """Parse `agentrl ARGV` as the CLI would, running no command: the names of the commands reached."""
    import typer.main

    from agentrl import cli

    group = typer.main.get_command(cli.app)  # a fresh command tree: the app itself is left as it is
    reached: list[str] = []

    def leaves(command):
        subcommands = getattr(command, "commands", None)
        if not subcommands:
            yield command
            return
        for sub in subcommands.values():
            yield from leaves(sub)

    for command in leaves(group):
        command.callback = lambda *args, _name=command.name, **kwargs: reached.append(_name)
    exit_code = group.main(argv, prog_name="agentrl", standalone_mode=False)
    assert exit_code in (None, 0), f"`agentrl {shlex.join(argv)}` does not parse (exit {exit_code})"
    return reached


def test_every_agentrl_command_line_parses(capsys):
    lines = command_lines("agentrl")
    assert len(lines) >= 15 and {p for p, _ in lines} >= {"README.md", "docs/TRAINING.md"}
    for page, argv in lines:
        assert len(parse_cli(argv)) == 1, f"{page}: `agentrl {shlex.join(argv)}` reaches no command"
    assert "error:" not in capsys.readouterr().err


def test_the_tours_check_commands_run(mylab):
    """The tour's `agentrl env check` and `agentrl verifier check` on the README's own environment."""
    from typer.testing import CliRunner

    from agentrl import cli

    tour = [argv for page, argv in command_lines("agentrl") if page == "README.md" and argv[1:2] == ["check"]]
    assert [argv[0] for argv in tour] == ["env", "verifier"]
    for argv in tour:
        result = CliRunner().invoke(cli.app, argv)
        assert result.exit_code == 0, f"agentrl {shlex.join(argv)}:\n{result.output}"


def test_every_make_line_names_a_target():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    inline = [
        (page.name, mention.split()[1:])
        for page in PAGES
        for mention in re.findall(r"`(make [\w-]+)", page.read_text())
    ]
    lines = command_lines("make") + inline
    assert {argv[0] for _, argv in lines} >= {"demo", "test", "check", "bench", "gpu-smoke"}
    for page, argv in lines:
        assert argv[0] in targets, f"{page}: `make {argv[0]}` is no target of the Makefile"


def test_every_yaml_block_is_a_valid_training_config():
    from agentrl.train.config import TrainConfig

    found = blocks("yaml")
    assert {p for p, _ in found} >= {"README.md", "docs/SCALING.md", "docs/GPUS.md"}
    for _, text in found:
        data = yaml.safe_load(text)
        TrainConfig.model_validate({"model": "runs/sft", **data})  # a fragment: the rest at its defaults


@pytest.mark.docker
def test_mcp_tools_snippet(capsys):
    from agentrl.env.mcp.images import ensure_image

    ensure_image()  # built by `make setup` (agentrl sandbox build); here only checked
    namespace: dict = {}
    exec(compile(block("mcp-server-sqlite"), "docs/ENVIRONMENTS.md", "exec"), namespace)
    names, count = capsys.readouterr().out.splitlines()[:2]
    assert "'read_query'" in names and names.startswith("['submit'")
    assert count == "[{'count(*)': 2}]" and namespace["reward"] == 1.0


def test_judged_reward_snippet(tmp_path, monkeypatch, capsys):
    from tests.verifiers.test_judge import Endpoint, scores

    endpoint = Endpoint()
    endpoint.reply = scores(10, 7)
    monkeypatch.chdir(tmp_path)
    try:
        code = block('get(\n    "judge",').replace("http://127.0.0.1:8000/v1", endpoint.url)
        exec(compile(code, "docs/VERIFIERS.md", "exec"), {})
    finally:
        endpoint.close()
    reward, judged, details = capsys.readouterr().out.split(" ", 2)
    assert float(reward) == pytest.approx((2 * 10 + 7) / 30) and judged == "True" and "C1 10/10" in details
    assert (tmp_path / "judge-cache.jsonl").is_file()
