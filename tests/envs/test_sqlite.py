import pytest

import agentrl
from agentrl.env.agents import run_episode, tool_call
from agentrl.envs.sqlite import SqliteTaskGenerator

from .conftest import floor_rewards, oracle_rewards


def test_generator_mixes_queries_and_changes_deterministically():
    g = SqliteTaskGenerator(seed=0)
    tasks = [g.generate(i) for i in range(60)]
    assert tasks == [SqliteTaskGenerator(seed=0).generate(i) for i in range(60)]
    mutating = [t for t in tasks if t.metadata["mutates"]]
    assert 10 < len(mutating) < 40
    assert all(t.check_command and "-init /dev/null" in t.check_command for t in mutating)


@pytest.mark.docker
@pytest.mark.slow
def test_oracle_solves_100_tasks_through_docker():
    rewards = oracle_rewards("agentrl/sqlite-v0", 100)
    assert rewards == [1.0] * 100


@pytest.mark.docker
def test_empty_and_random_agents_score_zero():
    assert set(floor_rewards("agentrl/sqlite-v0", 4)) == {0.0}


@pytest.mark.docker
def test_state_task_fails_when_the_agent_changes_something_else():
    env = agentrl.make("agentrl/sqlite-v0")
    try:
        task = next(
            t for i in range(50) if (t := env.tasks.get(i, env.split)).metadata["kind"] == "set_stock"
        )

        class Sloppy:
            """Does the change and also deletes every order: the state check must see it."""

            def __init__(self):
                self.turn = 0

            def act(self, obs):
                self.turn += 1
                if self.turn == 1:
                    sql = task.metadata["solution_sql"] + " DELETE FROM orders;"
                    return tool_call("bash", command=f'sqlite3 shop.db "{sql}"')
                return tool_call("submit", answer="done")

        result = run_episode(env, Sloppy(), options={"task": task})
        assert result.reward == 0.0 and "expected" in result.info["verdict"].details
    finally:
        env.close()


@pytest.mark.docker
def test_sqliterc_in_the_workspace_cannot_fake_the_state_check():
    """The agent's home is the workspace: a .sqliterc there must not shape the verifier's query output."""
    env = agentrl.make("agentrl/sqlite-v0")
    try:
        task = next(t for i in range(50) if (t := env.tasks.get(i, env.split)).metadata["mutates"])
        fake = task.answer.replace("\n", " ")

        class Faker:
            def __init__(self):
                self.turn = 0

            def act(self, obs):
                self.turn += 1
                if self.turn == 1:
                    return tool_call("write_file", path=".sqliterc", content=f".print '{fake}'\n.exit\n")
                return tool_call("submit", answer="done")

        assert run_episode(env, Faker(), options={"task": task}).reward == 0.0
    finally:
        env.close()
