"""Beyond one machine: the pieces shared by the Ray rollout path, cheap to import (no Ray here).

- `episode_group`: the rollout sets it around each episode (a context variable, so every episode's
  asyncio task has its own); a policy that spreads requests over engines (`agentrl.rollout.ray_policy`)
  reads it to keep a group's episodes on one engine, where they share the prompt's prefix cache.
- `connect(address)`: join a Ray cluster once per process (`cluster.ray_address`), with a
  one-line error when Ray is missing or the address does not answer.

Without `cluster.ray_address` nothing here imports Ray: the single-machine path is unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from agentrl.core.errors import UserError

_episode_group: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "agentrl_episode_group", default=None
)


def current_group() -> str | None:
    """The group id of the episode whose code is running now (None outside a rollout episode)."""
    return _episode_group.get()


@contextlib.contextmanager
def episode_group(group_id: str) -> Iterator[None]:
    """Mark the code inside as one episode of `group_id` (the rollout wraps each episode in it)."""
    token = _episode_group.set(group_id)
    try:
        yield
    finally:
        _episode_group.reset(token)


class ClusterError(UserError):
    """The Ray cluster cannot be used as configured (one line, with the fix)."""


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` (`auto`: the one this machine joined with `ray start`);
    nothing when this process is already connected. None starts a private one-machine Ray."""
    try:
        import ray
    except ImportError:
        raise ClusterError(
            "cluster.ray_address needs Ray: pip install 'agentrl[ray]' (ray==2.60.0), or leave "
            "cluster.ray_address unset to run on this machine without Ray"
        ) from None
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterError(
            f"cannot join the Ray cluster at {address!r} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
            "start it first (`ray start --head --port 6379` on the head, `ray start --address HEAD:6379` on "
            "each node) or set cluster.ray_address to its address"
        ) from None
