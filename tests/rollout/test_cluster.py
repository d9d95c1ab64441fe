"""The cluster knobs' checks and the episode-group marker (no Ray needed)."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.rollout.cluster import current_group, episode_group
from agentrl.train.config import ConfigError, load_config


def test_several_engines_without_a_cluster_is_one_line_naming_the_setting():
    with pytest.raises(ConfigError, match=r"engine.count=2 needs a Ray cluster: set cluster.ray_address"):
        load_config(None, ["engine.count=2"], model="m")


def test_several_engines_on_a_cluster_validate():
    cfg = load_config(
        None,
        ["engine.count=2", "cluster.ray_address=auto", "engine.resources=[{a: 1}, {b: 1}]"],
        model="m",
    )
    assert (cfg.engine.count, cfg.cluster.ray_address, cfg.engine.resources) == (
        2,
        "auto",
        [{"a": 1}, {"b": 1}],
    )


def test_each_concurrent_episode_sees_its_own_group():
    async def episode(group: str) -> list[str | None]:
        seen = []
        with episode_group(group):
            for _ in range(3):
                seen.append(current_group())
                await asyncio.sleep(0)
        return seen

    async def main():
        return await asyncio.gather(episode("a"), episode("b"))

    assert asyncio.run(main()) == [["a"] * 3, ["b"] * 3]
    assert current_group() is None
