"""Adapter directories (`agentrl.rollout.adapters`): what counts as one, and a push's bytes written as one.

No model and no vLLM here: the files are written by hand in peft's format (the engine tests in
test_lora_engine.py use adapters peft itself saved).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.core.errors import UserError
from agentrl.rollout.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_base,
    adapter_config,
    adapter_dir,
    adapter_rank,
    check_adapter_dir,
    is_adapter_dir,
    write_adapter_files,
)


def files(config: dict | None = None) -> dict[str, bytes]:
    """An adapter push: a config and (for these checks, opaque) weight bytes."""
    config = {"r": 8, "base_model_name_or_path": "/models/base"} if config is None else config
    return {ADAPTER_CONFIG: json.dumps(config).encode(), ADAPTER_WEIGHTS: b"weights"}


def test_an_adapter_directory_has_both_of_peft_files(tmp_path: Path) -> None:
    assert not is_adapter_dir(tmp_path)
    (tmp_path / ADAPTER_CONFIG).write_text("{}")
    assert not is_adapter_dir(tmp_path)
    with pytest.raises(UserError, match=f"it has no {ADAPTER_WEIGHTS}"):
        check_adapter_dir(tmp_path)
    (tmp_path / ADAPTER_WEIGHTS).write_bytes(b"")
    assert is_adapter_dir(tmp_path) and check_adapter_dir(str(tmp_path)) == tmp_path
    assert not is_adapter_dir(tmp_path / "missing")
    with pytest.raises(UserError, match="does not exist"):
        check_adapter_dir(tmp_path / "missing")


def test_config_base_and_rank_are_read_from_the_adapter_config(tmp_path: Path) -> None:
    write_adapter_files(
        files({"r": 4, "rank_pattern": {"q_proj": 16, "v_proj": 2}, "base_model_name_or_path": "/b"}),
        tmp_path,
    )
    assert adapter_config(tmp_path)["r"] == 4
    assert adapter_base(tmp_path) == "/b"
    assert adapter_rank(tmp_path) == 16  # the largest rank of any module: what the engine must hold
    write_adapter_files(files({}), tmp_path)
    assert adapter_rank(tmp_path) == 8  # peft's default r
    with pytest.raises(UserError, match="names no base model"):
        adapter_base(tmp_path)
    (tmp_path / ADAPTER_CONFIG).write_text("{not json")
    with pytest.raises(UserError, match="not a readable LoRA adapter config"):
        adapter_rank(tmp_path)


def test_a_push_needs_both_files_with_plain_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=ADAPTER_WEIGHTS):
        write_adapter_files({ADAPTER_CONFIG: b"{}"}, tmp_path / "a")
    assert not (tmp_path / "a").exists()  # nothing written for a push that is refused
    for bad in ("../evil", "sub/x", ".."):
        with pytest.raises(ValueError, match="not a plain file name"):
            write_adapter_files({**files(), bad: b"x"}, tmp_path / "b")
    assert not (tmp_path / "evil").exists()
    out = write_adapter_files({**files(), "tokenizer.json": b"{}"}, tmp_path / "c")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [ADAPTER_CONFIG, ADAPTER_WEIGHTS, "tokenizer.json"]
    )
    assert (out / ADAPTER_WEIGHTS).read_bytes() == b"weights"


def test_adapter_dir_writes_pushed_bytes_to_a_fresh_directory_and_uses_a_directory_as_is(
    tmp_path: Path,
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    first, owned = adapter_dir(files(), scratch)
    second, owned2 = adapter_dir(files(), scratch)
    assert owned == first and owned2 == second and first != second  # each push its own directory
    assert first.parent == scratch and is_adapter_dir(first)
    same, none = adapter_dir(first, scratch)
    assert same == first and none is None  # not ours to delete
    with pytest.raises(ValueError):
        adapter_dir({ADAPTER_CONFIG: b"{}"}, scratch)
    assert sorted(scratch.iterdir()) == sorted([first, second])  # a refused push leaves no directory
    with pytest.raises(UserError, match="not a LoRA adapter directory"):
        adapter_dir(scratch, scratch)


_SCRATCH_LEFT_OPEN = """
import os, signal, sys
from agentrl.rollout.vllm_adapters import VLLMAdapters
engine = object.__new__(VLLMAdapters)  # an engine's adapter side, as VLLMPolicy.__init__ sets it
engine._scratch, engine._scratch_cleanup = None, None
path = engine._scratch_dir()
(path / "adapter-x").mkdir()
print(path, flush=True)
if sys.argv[1] == "kill":  # the OOM killer, a crashed Ray actor: no exit hook runs
    os.kill(os.getpid(), signal.SIGKILL)
raise SystemExit(3)  # a run that stops on an error without closing its engine
"""


def _engine_left_open(how: str, tmp: Path) -> tuple[subprocess.CompletedProcess, Path]:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRATCH_LEFT_OPEN, how],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    return proc, Path(proc.stdout.strip())


def test_pushed_adapters_folder_goes_with_close_or_with_a_process_that_never_closed(tmp_path: Path) -> None:
    from agentrl.rollout.vllm_adapters import VLLMAdapters

    engine = object.__new__(VLLMAdapters)
    engine._scratch, engine._scratch_cleanup = None, None
    path = engine._scratch_dir()
    assert engine._scratch_dir() == path and path.is_dir()  # one folder per engine
    engine._drop_scratch()  # close()
    assert not path.exists()
    engine._drop_scratch()  # closing twice is harmless

    proc, left = _engine_left_open("exit", tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert left.parent == tmp_path and left.name.startswith("agentrl-adapters-") and not left.exists()


def test_a_killed_engines_folder_is_removed_by_the_next_engine_and_a_live_ones_is_not(tmp_path: Path) -> None:
    from agentrl.rollout.vllm_adapters import claim_scratch

    proc, killed = _engine_left_open("kill", tmp_path)
    assert proc.returncode == -9 and (killed / "adapter-x").is_dir(), proc.stderr
    live, fd = claim_scratch(tmp_path)  # this process's engine, alive
    other, other_fd = claim_scratch(tmp_path)  # another one, which sweeps again
    assert not killed.exists() and live.is_dir() and other.is_dir()
    os.close(fd)  # the first engine's process is gone: the next claim removes its folder
    _, last_fd = claim_scratch(tmp_path)
    assert not live.exists() and other.is_dir()
    os.close(other_fd)
    os.close(last_fd)
