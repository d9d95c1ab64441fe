"""Episodes that an agent outside the loop plays: the protocol the rollout drives them through.

The rollout loop (`agentrl.rollout.loop`) plays an environment itself, turn by turn: generate, step,
append. An environment whose episodes some other agent plays (the user's own agent, talking to the
policy through an OpenAI-compatible session: `agentrl.gateway.HarnessEnv`) says so with one method,
`episode_driver(context)`. For each of its episodes the loop hands it the `EpisodeContext` (the policy,
the masker, the rollout's settings, the episode's seed, index and group, and the way to call the
environment on a worker thread) and drives the `EpisodeDriver` it returns:

    driver = env.episode_driver(context)
    await driver.play(seed=env_seed, options={"task": task})   # reset, the agent's play, the ending
    driver.sampled_versions()                                   # for `on_push: restart`
    driver.trajectories(base)                                   # one per branch of its calls

This stage defines the protocol and the stage above implements it, so the rollout never imports the
gateway: any package's environment can be played by an agent of its own the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.masker import ChatMasker, MaskedSequence
from agentrl.rollout.policy import Policy
from agentrl.rollout.trajectory import Trajectory

EpisodePolicyFactory = Callable[[Any, MaskedSequence | None], Policy]
"""(environment after `reset`, the episode's masked sequence) -> the policy that plays this episode. An
episode a driver plays has no sequence of the loop's (None): the policy answers the agent's calls."""


@dataclass(frozen=True)
class EpisodeContext:
    """What the loop gives a driver for one episode."""

    policy: Policy
    """The rollout's policy: what samples the agent's calls (unless `episode_policy` gives another)."""
    masker: ChatMasker
    """The rollout's masker: its tokenizer and chat template render the agent's conversations."""
    rollout: RolloutConfig
    seed: int | None
    """The rollout call's base seed: the episode samples with seeds derived from (seed, index, turn)."""
    index: int
    group_id: str
    env_call: Callable[..., Awaitable[Any]]
    """`await env_call(fn, *args)`: `fn(*args)` on an environment worker thread, timed as the episode's
    environment time (a slow tool never stalls the loop)."""
    episode_policy: EpisodePolicyFactory | None = None


class EpisodeDriver(Protocol):
    """One episode, played by an agent outside the loop."""

    async def play(self, *, seed: int | None, options: dict[str, Any]) -> None:
        """Reset the environment (with `seed` and `options`), let the agent play, end the episode: the
        environment's `episode` then records how it ended and its verdict."""
        ...

    def sampled_versions(self) -> set[int]:
        """The weights versions of every id the policy sampled for it (more than one: weights were
        pushed while it ran)."""
        ...

    def trajectories(self, base: Trajectory) -> list[Trajectory]:
        """The episode's trajectories, from `base` (its trajectory as the loop makes it, without tokens):
        one per branch of the agent's calls, branch 0 first; `[base]` when the agent never sampled."""
        ...


@runtime_checkable
class DrivenEnv(Protocol):
    """An environment whose episodes an agent outside the loop plays."""

    def episode_driver(self, context: EpisodeContext) -> EpisodeDriver: ...


def is_driven(env: Any) -> bool:
    """Whether the loop hands `env`'s episodes to a driver (`DrivenEnv`) instead of playing them itself."""
    return callable(getattr(type(env), "episode_driver", None))
