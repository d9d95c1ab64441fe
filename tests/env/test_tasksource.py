"""Task sources: fixed datasets (list, JSONL, Hugging Face `datasets`) and generators, validated at the boundary."""

from __future__ import annotations

import json

import datasets
import pytest

import agentrl
from agentrl.core.task import Task
from agentrl.env.tasksource import TaskPool, TaskSourceError, as_task_source
from agentrl.env.tool_env import ToolEnv
from agentrl.train.curriculum import Curriculum, CurriculumConfig, DynamicBatch, build_curriculum

ROWS = [
    {"prompt": "Say a", "answer": "a"},
    {"prompt": "Say b", "answer": "b", "difficulty": 2},
    {"id": "held/0", "prompt": "Say c", "answer": "c", "split": "test"},
]


def test_a_list_of_dicts_is_a_pool_split_by_each_rows_split_field():
    pool = as_task_source(ROWS, name="mylab/Say-v0")
    assert pool.split_sizes() == {"train": 2, "test": 1}
    first = pool.get(0, "train")
    assert (first.id, first.prompt, first.answer, first.split) == ("mylab/Say-v0/0", "Say a", "a", "train")
    # A key that is not a Task field goes into metadata; task i of a split wraps around.
    assert pool.get(1, "train").metadata == {"difficulty": 2}
    assert pool.get(2, "train").id == first.id
    assert pool.get(0, "test").id == "held/0"


def test_a_jsonl_file_is_a_pool_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    pool = as_task_source(str(path))
    assert pool.size("train") == 2 and pool.get(1, "train").answer == "b"
    path.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(TaskSourceError, match=r"tasks.jsonl:2 is not a JSON object"):
        as_task_source(path).size("train")


def test_a_huggingface_dataset_with_renamed_columns_and_a_split_mapping():
    train = datasets.Dataset.from_dict({"question": ["2+2?", "3+3?"], "solution": [4, 6]})
    test = datasets.Dataset.from_dict({"question": ["5+5?"], "solution": [10]})
    pool = TaskPool(
        datasets.DatasetDict({"train": train, "test": test}),
        name="arith",
        columns={"prompt": "question", "answer": "solution"},
    )
    assert pool.split_sizes() == {"train": 2, "test": 1}
    task = pool.get(1, "train")
    # Numeric answers become strings (verifiers compare text); ids are stable per split and row.
    assert (task.prompt, task.answer, task.split, task.id) == ("3+3?", "6", "train", "arith/train/1")
    assert pool.get(0, "test").id == "arith/test/0"


def test_a_dataset_with_its_own_conversion():
    ds = datasets.Dataset.from_dict({"q": ["x", "y"]})
    pool = TaskPool(ds, to_task=lambda row, i: Task(id=f"t{i}", prompt=row["q"].upper()))
    assert pool.get(1).prompt == "Y"
    bad = TaskPool(ds, to_task=lambda row, i: row)
    with pytest.raises(TaskSourceError, match=r"to_task\(row 0 of dataset\) returned a dict"):
        bad.get(0)


class Garbage:
    def __init__(self, value):
        self.value = value

    def generate(self, index, split="train"):
        return self.value


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (None, r"returned None, not an agentrl.Task. Did a code path miss its `return`\?"),
        ({"id": "x", "prompt": "p"}, r"returned a dict \(keys: id, prompt\), not an agentrl.Task. Build one"),
        ("a task", r"returned a str \('a task'\), not an agentrl.Task"),
    ],
)
def test_a_generator_returning_garbage_is_one_clear_error_naming_it(value, said):
    env = ToolEnv(
        tasks=Garbage(value), tools=["submit"], backend="local", use_pool=False, env_id="mylab/G-v0"
    )
    where = (
        r"task generator tests.env.test_tasksource:Garbage.generate\(0, 'train'\) \(environment mylab/G-v0\) "
    )
    with pytest.raises(TaskSourceError, match=where + said):
        env.reset(options={"index": 0})


def test_empty_datasets_missing_splits_and_bad_rows_are_said_plainly():
    with pytest.raises(TaskSourceError, match="the task list of mylab/E-v0 is empty"):
        ToolEnv(tasks=[], tools=["submit"], env_id="mylab/E-v0", backend="local").reset()
    with pytest.raises(TaskSourceError, match=r"tasks has no validation tasks \(it has 2 train, 1 test\)"):
        as_task_source(ROWS).get(0, "validation")
    with pytest.raises(TaskSourceError, match=r"row 0 of tasks: invalid task: 'prompt' is required"):
        as_task_source([{"answer": "a"}]).get(0)
    with pytest.raises(TaskSourceError, match="row 0 of tasks is an int"):
        as_task_source([3]).get(0)
    with pytest.raises(
        TaskSourceError, match="a mapping of tasks must be keyed by split.*'trian'. Did you mean 'train'"
    ):
        as_task_source({"trian": ROWS}).size()
    with pytest.raises(TaskSourceError, match="expected a task generator"):
        as_task_source(42)


def test_a_zero_argument_callable_is_loaded_on_first_use_only():
    calls = []

    def load():
        calls.append(1)
        return ROWS

    src = as_task_source(load)
    assert calls == []
    assert src.size("train") == 2 and src.get(0, "test").id == "held/0" and calls == [1]


def test_register_with_a_jsonl_path_needs_no_subclass(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    agentrl.register(
        "mylab/Say-v0", "agentrl:ToolEnv", tasks=str(path), tools=["submit"], verifier="exact-match",
        oracle=agentrl.AnswerOracle, max_turns=2,
    )  # fmt: skip
    try:
        env = agentrl.make("mylab/Say-v0", backend="local", use_pool=False)
        task = env.tasks.get(0, "test")
        result = agentrl.run_episode(env, env.oracle(task), options={"task": task})
        assert result.reward == 1.0 and not env.needs_sandbox  # submit needs no container
        env.close()
    finally:
        agentrl.env.registry.registry.pop("mylab/Say-v0")


# --- the curriculum over a finite pool ---------------------------------------------------------------


def pool_curriculum(n: int, **cfg) -> Curriculum:
    src = as_task_source([{"id": f"t{i}", "prompt": str(i)} for i in range(n)])
    return build_curriculum(src, CurriculumConfig(**cfg))


def test_a_finite_pool_is_probed_once_in_a_seeded_order_then_drawn_from_what_is_tracked():
    cur = pool_curriculum(5, probe_prob=1.0, reprobe_prob=0.0, seed=3)
    first = cur.sample(5)
    assert sorted(d.task_id for d in first) == [f"t{i}" for i in range(5)]
    assert [d.kind for d in first] == ["probe"] * 5 and cur.exhausted
    assert [d.task_id for d in first] == [
        d.task_id for d in pool_curriculum(5, probe_prob=1.0, reprobe_prob=0.0, seed=3).sample(5)
    ]
    assert [d.task_id for d in first] != [f"t{i}" for i in range(5)]  # not the file's order
    for d, passes in zip(first, [1, 2, 3, 0, 4], strict=True):
        cur.observe(d.task_id, [1.0] * passes + [0.0] * (4 - passes))
    # Every task is tracked: a draw meant as a probe goes to the band (p̂ in [0.2, 0.8]) instead.
    again = cur.sample(3)
    assert all(d.kind == "band" and 0.2 <= d.p_hat <= 0.8 for d in again)
    assert len({d.task_id for d in again}) == 3


def test_a_batch_larger_than_the_pool_stops_when_the_pool_runs_out():
    cur = pool_curriculum(3, probe_prob=0.5)
    builder = DynamicBatch(cur, batch_groups=8, max_gen_factor=2.0)
    rounds = 0
    while not builder.done:
        draws = builder.request()
        builder.add([[_traj(d.task_id, r) for r in (0.0, 1.0)] for d in draws])
        rounds += 1
        assert rounds < 10
    result = builder.result()
    assert len(result.groups) == 3 and builder.pool_exhausted and not result.full


def _traj(task_id: str, reward: float):
    from agentrl.rollout.trajectory import Trajectory

    return Trajectory(
        task_id=task_id, group_id=task_id, token_ids=[1, 2], loss_mask=[0, 1], behavior_logprobs=[0.0, -1.0],
        prompt_len=1, reward=reward, passed=reward >= 1, finish_reason="submitted", policy_version=0,
    )  # fmt: skip
