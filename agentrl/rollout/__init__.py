"""Stage 2 of the pipeline: a policy plays many multi-turn episodes at once, token ids in and out.

- `policy`: the `Policy` contract (ids in, sampled ids and their log-probs out) and its engines;
- `masker`: the observation-token masker (sampled ids mask 1, environment ids mask 0);
- `trajectory`: `Trajectory`, one finished episode as the trainer sees it;
- `loop`: the rollout loop, `collect`: generate -> step -> append for every episode in flight.
"""

from typing import Any as _Any


def __getattr__(name: str) -> _Any:
    # What `agentrl.rollout` held when it was one module, kept importable for a while (deprecated).
    from agentrl._moved import forward_old_names

    return forward_old_names(__name__, name)
