"""`check_env`: does an environment keep the contract? Public API, like Gymnasium's `check_env`.

Checks, each with a message that says what broke:
- observation and action spaces are declared Gymnasium spaces;
- `reset(seed=s)` is deterministic: the same seed gives the same first observation;
- observations are in the observation space; reward is 0 before the episode ends;
- garbage actions (empty text, broken JSON, an unknown tool, wrong argument types, a call cut
  short, a huge message), written in the env's own tool-call format, each give an error
  observation the model can read, never an exception;
- stepping after the end raises a clear error; `close()` twice is safe; `reset()` after
  `close()` works.
"""

from __future__ import annotations

from typing import Any

import gymnasium

from agentrl.env.parsers import ToolCallParser


def garbage_actions(parser: ToolCallParser) -> dict[str, str]:
    """Messages a model gets wrong, each written in `parser`'s format (a format whose rendering does not
    contain the JSON we break leaves that case out)."""
    submit = parser.render_calls([("submit", {"answer": "1"})])
    actions = {
        "empty": "",
        "not a tool call": "I think the answer is probably something.",
        "unknown tool": parser.render_calls([("definitely_not_a_tool", {})]),
        "arguments not an object": parser.render_calls([("submit", [1, 2])]),
        "cut short": submit[: len(submit) * 2 // 3],
    }
    if '{"answer": "1"}' in submit:
        actions["broken json"] = submit.replace('{"answer": "1"}', '{"answer": ', 1)
    return actions


def _fail(msg: str) -> None:
    raise AssertionError(f"check_env: {msg}")


def _wrong_types_action(env: Any) -> str | None:
    """A call to the env's first non-terminal tool with every argument of the wrong type."""
    for t in env.toolbox.tools.values():
        props = t.parameters.get("properties", {})
        if props:
            bad = {k: ([1, 2] if v.get("type") != "array" else {"x": 1}) for k, v in props.items()}
            return env.parser.render_calls([(t.name, bad)])
    return None


def check_env(env: Any, *, seed: int = 1234, skip_close_check: bool = False) -> None:
    """Raise AssertionError with a precise message when `env` breaks the contract; return None when it keeps it."""
    if not isinstance(env, gymnasium.Env):
        _fail(f"{type(env).__name__} is not a gymnasium.Env subclass")
    for name in ("observation_space", "action_space"):
        if not isinstance(getattr(env, name, None), gymnasium.spaces.Space):
            _fail(f"env.{name} must be a gymnasium.spaces.Space, got {getattr(env, name, None)!r}")

    obs1, info1 = env.reset(seed=seed)
    obs2, info2 = env.reset(seed=seed)
    if obs1 != obs2 or info1.get("task_id") != info2.get("task_id"):
        _fail(f"reset(seed={seed}) twice gave different observations: not deterministic")
    if not env.observation_space.contains(obs1):
        _fail(f"the first observation is not in the observation space {env.observation_space}: {obs1!r:.300}")
    if not isinstance(info1, dict):
        _fail(f"reset must return (observation, info dict), info is {type(info1).__name__}")

    actions = garbage_actions(env.parser)
    actions["huge"] = "x" * (getattr(env, "max_action_chars", 65536) + 1)
    if (wrong := _wrong_types_action(env)) is not None:
        actions["wrong argument types"] = wrong
    env.reset(seed=seed)
    for label, action in actions.items():
        if env.episode is not None and env.episode.done:
            env.reset(seed=seed)
        try:
            obs, reward, terminated, truncated, info = env.step(action)
        except Exception as exc:
            _fail(f"step() raised on a garbage action ({label}): {type(exc).__name__}: {exc}")
        if not env.observation_space.contains(obs):
            _fail(f"observation after the {label} action is not in the observation space: {obs!r:.300}")
        if not obs or not any("error" in m["content"].lower() for m in obs):
            _fail(f"the {label} action did not produce an error observation the model can read: {obs!r:.300}")
        if not (terminated or truncated) and reward != 0:
            _fail(f"reward must be 0 before the episode ends, got {reward} after the {label} action")
        if (terminated or truncated) and "finish_reason" not in info:
            _fail("info must carry `finish_reason` when the episode ends")

    # Play the episode out (empty actions) and check the end is handled.
    env.reset(seed=seed)
    for _ in range(getattr(env, "max_turns", 100) + 1):
        _, _, terminated, truncated, info = env.step("")
        if terminated or truncated:
            break
    else:
        _fail("the episode never ended: truncation at max_turns is missing")
    if info.get("finish_reason") != "max_turns":
        _fail(
            f"an episode of empty actions should end with finish_reason 'max_turns', got {info.get('finish_reason')!r}"
        )
    try:
        env.step("")
        _fail("step() after the episode ended should raise a clear error telling to call reset()")
    except RuntimeError:
        pass

    if not skip_close_check:
        env.close()
        env.close()
        obs3, _ = env.reset(seed=seed)
        if obs3 != obs1:
            _fail("reset(seed) after close() gave a different observation")
        env.close()
