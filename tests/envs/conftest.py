from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import agentrl
from agentrl.env.agents import EmptyAgent, RandomAgent, run_episode


def oracle_rewards(env_id: str, n: int, split: str = "train", workers: int = 4, **make_kwargs) -> list[float]:
    """Run the env's oracle on tasks 0..n-1 of `split`, `workers` envs in parallel (each its own sandbox)."""

    def run_slice(k: int) -> list[float]:
        env = agentrl.make(env_id, **make_kwargs)
        try:
            out = []
            for i in range(k, n, workers):
                task = env.tasks.get(i, split)
                out.append(run_episode(env, env.oracle(task), options={"task": task}).reward)
            return out
        finally:
            env.close()

    with ThreadPoolExecutor(workers) as pool:
        return [r for part in pool.map(run_slice, range(workers)) for r in part]


def floor_rewards(env_id: str, n: int, **make_kwargs) -> list[float]:
    env = agentrl.make(env_id, **make_kwargs)
    try:
        rewards = []
        for i in range(n):
            rewards.append(run_episode(env, EmptyAgent(), seed=i).reward)
            rewards.append(run_episode(env, RandomAgent(list(env.toolbox.tools), seed=i), seed=i).reward)
        return rewards
    finally:
        env.close()
