"""Bad input, across the commands: one clear line on stderr (`error: ...`), exit status 2, no traceback.

Every case runs the real `agentrl` command in a subprocess, as a user would.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

ROOT = Path(__file__).resolve().parents[2]
AGENTRL = str(ROOT / ".venv/bin/agentrl")

# (case, argv with {tiny} {tmp} {cfg} {empty} placeholders, what the one line must say)
CASES = [
    ("env show: misspelled id", "env show agentrl/calc-vv0",
     "environment 'agentrl/calc-vv0' not found. Did you mean 'agentrl/calc-v0'"),
    ("env check: misspelled id", "env check agentrl/clac-v0 --backend local",
     "environment 'agentrl/clac-v0' not found. Did you mean 'agentrl/calc-v0'"),
    ("env show: generator returns None", "env show tests.garbage_envs:test/NoneTasks-v0",
     "task generator tests.garbage_envs:NoneTasks.generate(0, 'train') (environment test/NoneTasks-v0) returned None"),
    ("env check: empty dataset", "env check tests.garbage_envs:test/Empty-v0 --backend local",
     "the task list of test/Empty-v0 is empty"),
    ("demos: generator returns a dict", "demos tests.garbage_envs:test/DictTasks-v0 --n 2 --out {tmp}/d.jsonl --model {tiny}",
     "returned a dict (keys: id, prompt), not an agentrl.Task"),
    ("demos: missing model", "demos agentrl/calc-v0 --n 2 --out {tmp}/d.jsonl --model {tmp}/no/such/model",
     "--model {tmp}/no/such/model: no such directory"),
    ("train: unknown config key", "train {cfg} optim.lrr=1e-4",
     "unknown key 'optim.lrr'. Did you mean 'optim.lr'?"),
    ("train: wrong type", "train {cfg} steps=many",
     "'steps': input should be a valid integer, unable to parse string as an integer (got 'many')"),
    ("train: --nproc 0", "train {cfg} --nproc 0", "--nproc must be >= 1"),
    ("train: missing model", "train {cfg} model={tmp}/a/b/missing", "model {tmp}/a/b/missing: no such directory"),
    ("train: not a checkpoint", "train {cfg} model={tmp}", "is not a checkpoint: no config.json"),
    ("train: garbage generator", "train {cfg} env=tests.garbage_envs:test/DictTasks-v0", "returned a dict"),
    ("train: empty dataset", "train {cfg} env=tests.garbage_envs:test/Empty-v0", "the task list of test/Empty-v0 is empty"),
    ("train: empty replay file", "train {cfg} replay={empty}", "replay file {empty} is empty"),
    ("train: missing config file", "train {tmp}/nope.yaml", "config file {tmp}/nope.yaml does not exist"),
    ("train: misspelled config file", "train {tmp}/train.yml",
     "config file {tmp}/train.yml does not exist. Did you mean '{tmp}/train.yaml'?"),
    ("train: option of the wrong type", "train {cfg} --rollout.temperature hot",
     "invalid value for --rollout.temperature: input should be a valid number"),
    ("train: option out of bounds", "train {cfg} --optim.lr 0", "invalid value for --optim.lr: input should be greater than 0"),
    ("train: misspelled option", "train {cfg} --rollout.temprature 0.5",
     "No such option: --rollout.temprature (Possible options: --eval.temperature, --rollout.temperature"),
    ("sft: fractional epochs", "sft --model {tiny} --data {empty} --out {tmp}/sft --epochs 0.5",
     "invalid value for --epochs: input should be a valid integer"),
    ("sft: missing model", "sft --model {tmp}/missing --data {empty} --out {tmp}/sft", "--model {tmp}/missing: no such directory"),
    ("sft: empty data file", "sft --model {tiny} --data {empty} --out {tmp}/sft", "--data {empty} is empty"),
    ("sft: misspelled data file", "sft --model {tiny} --data {tmp}/emty.jsonl --out {tmp}/sft",
     "--data {tmp}/emty.jsonl: no such file. Did you mean '{tmp}/empty.jsonl'?"),
    ("sft: --nproc 0", "sft --model {tiny} --data {empty} --out {tmp}/sft --nproc 0", "--nproc must be >= 1"),
    ("eval: misspelled id", "eval --env agentrl/calc-vv0 --model {tiny} --out {tmp}/ev",
     "environment 'agentrl/calc-vv0' not found"),
    ("eval: model path is not a checkpoint", "eval --env agentrl/calc-v0 --model {tmp} --out {tmp}/ev",
     "--model {tmp} is not a checkpoint: no config.json"),
    ("eval: wrong type", "eval --env agentrl/calc-v0 --model {tiny} --n many",
     "invalid value for --samples, --n: input should be a valid integer"),
    ("eval: a k above the samples", "eval --env agentrl/calc-v0 --model {tiny} --samples 2 --k 1,4",
     "pass@4 needs at least 4 samples per task but samples=2"),
    ("eval: group size is not an eval option", "eval --env agentrl/calc-v0 --model {tiny} --group-size 4",
     "No such option: --group-size"),
    ("rollout: generator returns None", "rollout --env tests.garbage_envs:test/NoneTasks-v0 --model {tiny} --out {tmp}/r.jsonl",
     "returned None, not an agentrl.Task"),
    ("rollout: missing model", "rollout --env agentrl/calc-v0 --model /no/such/dir/model --out {tmp}/r.jsonl",
     "--model /no/such/dir/model: no such directory"),
    ("verifier check: generator returns a dict", "verifier check tests.garbage_envs:test/DictTasks-v0 --backend local",
     "returned a dict"),
    ("unknown command", "trian {cfg}", "No such command 'trian'"),
]  # fmt: skip


@pytest.fixture(scope="module")
def paths(tiny_model_dir, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "empty.jsonl").write_text("\n")
    cfg = tmp / "train.yaml"
    cfg.write_text(f"env: tests.coin_env:test/Coin-v0\nmodel: {tiny_model_dir}\nout: {tmp}/run\nsteps: 1\n")
    return {"tiny": str(tiny_model_dir), "tmp": str(tmp), "cfg": str(cfg), "empty": str(tmp / "empty.jsonl")}


def run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("AGENTRL_DEBUG", None)
    return subprocess.run([AGENTRL, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize(("case", "argv", "said"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_exit_2(case, argv, said, paths):
    res = run(argv.format(**paths).split())
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, (case, res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert said.format(**paths) in lines[0], lines[0]


def test_debug_shows_the_traceback(paths):
    res = run(["--debug", "env", "show", "agentrl/calc-vv0"])
    assert res.returncode == 1 and "Traceback" in res.stderr and "UnknownEnvError" in res.stderr
