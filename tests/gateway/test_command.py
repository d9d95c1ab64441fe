"""Harness commands inside the sandbox: the command reaches its own gateway session over the relay and
nothing else (no network, no other session, no other route), every ending is recorded, and mini-swe-agent
from the package index repairs (or fails to repair) a python-repair package in docker through the gateway.
"""

from __future__ import annotations

import json

import pytest

from agentrl.envs.python_repair.env import PythonRepairEnv
from agentrl.gateway.harness import HarnessEnv
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.loop import collect_sync
from tests import fixtures_model, fixtures_net
from tests.gateway.scripted import RecordingPolicy, ToolCallPolicy, assert_all_sampled

tiny_model_dir = fixtures_model.tiny_model_dir
loopback_listener = fixtures_net.loopback_listener

# A client with the standard library only (the image has no openai SDK): one completion, then proof that
# the rest of the gateway and the network are out of reach. Any failure exits non-zero: `agent_error`.
CLIENT = r"""
import json, os, socket, sys, urllib.error, urllib.request
base = os.environ["OPENAI_BASE_URL"]
body = {"model": os.environ["AGENTRL_MODEL"], "messages": [{"role": "user", "content": os.environ["AGENTRL_TASK"][:300]}]}
req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
print("REPLY", json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]["content"])
root = base.split("/s/")[0]
for path in ("/v1/models", "/s/" + "A" * 32 + "/v1/models", "/docs"):
    try:
        urllib.request.urlopen(root + path, timeout=10)
        sys.exit("reached " + path)
    except urllib.error.HTTPError as exc:
        assert exc.code == 404, (path, exc.code)
# A listener on the host's loopback, which the test process reaches: the sandbox's loopback is its own.
host_port = int(os.environ["HOST_PORT"])
assert host_port != int(root.rsplit(":", 1)[1]), "the host's port is the relay's: rerun"
try:
    socket.create_connection(("127.0.0.1", host_port), timeout=3)
    sys.exit("the host's loopback is reachable")
except OSError:
    pass
if open("/proc/net/dev").read().count(":") != 1:
    sys.exit("an interface besides loopback: " + open("/proc/net/dev").read())
assert open(os.environ["AGENTRL_TASK_FILE"]).read() == os.environ["AGENTRL_TASK"]
"""

CFG = RolloutConfig(group_size=1, max_tokens_per_turn=256, max_total_tokens=8192, episode_timeout_s=120)


def _reply(text: str):
    return lambda _prompt, _n: text


def _tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _env(task, backend: str = "docker", **harness) -> HarnessEnv:
    return HarnessEnv(PythonRepairEnv(tasks=[task], max_turns=6, backend=backend), **harness)


@pytest.mark.docker
@pytest.mark.parametrize("backend", ["docker", "bwrap"])
def test_a_command_reaches_its_session_and_nothing_else(
    backend, semver_repair_task, tiny_model_dir, loopback_listener
):
    assert loopback_listener.reachable_from_here()
    seen = len(loopback_listener.accepted)
    record = RecordingPolicy(ToolCallPolicy(_tok(tiny_model_dir), _reply("I looked at it.")))
    command_env = {"HOST_PORT": str(loopback_listener.port)}
    [t] = collect_sync(
        lambda: _env(semver_repair_task, backend, command=["python3", "-c", CLIENT], command_env=command_env),
        [0],
        record,
        CFG,
        seed=0,
    )
    assert len(loopback_listener.accepted) == seen
    assert t.finish_reason == "submitted", t.error
    assert t.reward == 0.0 and not t.passed and t.verdict_details  # scored on the untouched mutant
    assert t.turns == 1 and t.branches == 1 and assert_all_sampled(t, record) == 1


@pytest.mark.docker
@pytest.mark.parametrize(
    ("command", "reason", "words"),
    [
        ("echo trying; exit 3", "agent_error", "exited 3; its output ends: trying"),
        ("sleep 600", "timeout", "wall-clock"),
        # $PPID is the relay itself: a command that kills its link ends its own episode.
        ("kill -9 $PPID; sleep 30", "agent_error", "ended before the command did"),
        # A flood of output: capped on the host, the episode goes on.
        ("python3 -c 'print(\"x\" * 10**7)'", "submitted", ""),
    ],
)
def test_every_ending_of_a_command_is_recorded(command, reason, words, semver_repair_task, tiny_model_dir):
    policy = ToolCallPolicy(_tok(tiny_model_dir), _reply("ok"))
    # The wall clock is short only where it is what ends the episode: on a loaded box (the suite's
    # other worker starting containers beside this one) the other endings need more than 8 s to play out.
    cfg = CFG.model_copy(update={"episode_timeout_s": 8.0 if reason == "timeout" else 120.0})
    [t] = collect_sync(lambda: _env(semver_repair_task, command=command), [0], policy, cfg, seed=0)
    assert t.finish_reason == reason and words in (t.error or "")
    assert t.verdict_details, "scored all the same"


# mini-swe-agent as a user runs it: its CLI, from the package index, installed into the task's image.
MINI = (
    "python3 -m minisweagent.run.mini -y --exit-immediately -l 0 -m openai/$AGENTRL_MODEL "
    '-c mini.yaml -c agent.step_limit=6 -o /tmp/mini.traj.json -t "$AGENTRL_TASK"'
)
# The same CLI speaking the other dialects through litellm: Anthropic's Messages API (its base URL is the
# session's without /v1) and the Responses API.
MINI_DIALECTS = {
    "chat": MINI,
    "messages": 'ANTHROPIC_API_BASE="${OPENAI_BASE_URL%/v1}" ANTHROPIC_API_KEY=agentrl-session '
    + MINI.replace("-m openai/", "-m anthropic/"),
    "responses": MINI.replace("-m openai/", "-m openai/responses/"),
}
MINI_ENV = {
    "MSWEA_CONFIGURED": "true",  # no first-run questions
    "MSWEA_COST_TRACKING": "ignore_errors",  # a local model has no price
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm would fetch its price list
    "HOME": "/tmp",
}
MINI_INSTALL = ["mini-swe-agent==2.4.6"]


def bash_call(command: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"Next step.\n<tool_call>\n{call}\n</tool_call>"


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("dialect", list(MINI_DIALECTS))
def test_mini_swe_agent_repairs_a_package_in_docker(
    semver_repair_task, tiny_model_dir, dialect, loopback_listener
):
    """Scripted replies (the tiny model cannot repair anything): the commands mini-swe-agent runs are its
    own, in the container; the fix it applies is scored by the hidden tests. In each dialect the CLI
    speaks (chat completions, Anthropic's Messages, Responses), one token-exact branch."""
    meta = semver_repair_task.metadata
    fix = (
        "python3 - <<'EOF'\nimport pathlib\n"
        f"p = pathlib.Path({meta['module']!r})\n"
        f"p.write_text(p.read_text().replace({meta['mutated_function']!r}, {meta['original_function']!r}, 1))\n"
        "EOF"
    )
    steps = [
        # The host's loopback listener, which the test reaches: the container's loopback is its own.
        f"python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:{loopback_listener.port}', "
        'timeout=5)" 2>/dev/null || echo OFFLINE',
        fix,
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
    ]
    record = RecordingPolicy(ToolCallPolicy(_tok(tiny_model_dir), lambda _p, n: bash_call(steps[min(n, 2)])))
    # Room for the whole fix in one reply (a cut one is dropped by mini-swe-agent: a branch of its own).
    cfg = CFG.model_copy(
        update={"episode_timeout_s": 300.0, "max_tokens_per_turn": 4096, "max_total_tokens": 32768}
    )
    [t] = collect_sync(
        lambda: _env(
            semver_repair_task, command=MINI_DIALECTS[dialect], command_env=MINI_ENV, install=MINI_INSTALL
        ),
        [0],
        record,
        cfg,
        seed=0,
    )
    assert t.finish_reason == "submitted", t.error
    assert t.reward == 1.0 and t.passed
    assert t.turns == 3 and t.branches == 1 and t.drifted_calls == 0
    assert assert_all_sampled(t, record) == 3
    assert any("OFFLINE" in str(m.get("content")) for m in t.messages), "the sandbox has no network"
    assert loopback_listener.reachable_from_here() and len(loopback_listener.accepted) == 1


@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
def test_mini_swe_agent_driven_by_the_local_model(semver_repair_task, tiny_model_dir):
    """The tiny model through vLLM: it cannot repair anything, but every episode ends with a reason and a
    score, and what is trained on is what the engine sampled."""
    from agentrl.rollout.policy import VLLMPolicy

    policy = VLLMPolicy(
        tiny_model_dir,
        in_process=True,
        dtype="float32",
        max_model_len=4096,
        cpu_threads=1,
        engine_kwargs={"enable_prefix_caching": False},
    )
    try:
        record = RecordingPolicy(policy)
        cfg = CFG.model_copy(
            update={
                "group_size": 2,
                "max_tokens_per_turn": 48,
                "max_total_tokens": 4096,
                "episode_timeout_s": 300.0,
            }
        )
        trajs = collect_sync(
            lambda: _env(semver_repair_task, command=MINI, command_env=MINI_ENV, install=MINI_INSTALL),
            [0],
            record,
            cfg,
            seed=0,
        )
    finally:
        policy.close()
    assert {t.group_id for t in trajs} and len({t.group_id for t in trajs}) == 1
    for t in trajs:
        assert t.finish_reason in ("submitted", "max_turns", "max_tokens"), t.error
        assert t.reward == 0.0 and t.verdict_details
        assert t.turns >= 1 and assert_all_sampled(t, record) >= 1
