"""The module paths from before the stage packages still import (deprecated) and lead to the new ones."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

from agentrl._moved import MOVED, MOVED_INTO_PACKAGE

ROOT = Path(__file__).resolve().parents[1]


def test_an_old_path_warns_and_gives_the_new_modules_objects():
    with pytest.warns(DeprecationWarning, match=r"agentrl\.passk moved to agentrl\.eval\.passk"):
        from agentrl.passk import pass_at_k  # type: ignore[import-not-found]
    from agentrl.eval.passk import pass_at_k as new

    assert pass_at_k is new


def test_every_new_path_exists_and_no_old_path_is_a_file_any_more():
    assert all(importlib.util.find_spec(new) is not None for new in MOVED.values())
    leftovers = [old for old in MOVED if (ROOT / (old.replace(".", "/") + ".py")).exists()]
    assert not leftovers


def test_an_old_module_that_is_now_a_package_forwards_its_old_names():
    with pytest.warns(
        DeprecationWarning, match=r"agentrl\.train\.launch moved to agentrl\.train\.trainer\.launch"
    ):
        from agentrl.train import launch
    from agentrl.train.trainer import launch as new

    assert launch is new and set(MOVED_INTO_PACKAGE) == {"agentrl.rollout", "agentrl.train"}


def test_a_name_neither_had_is_still_an_import_error():
    with pytest.raises(ImportError):
        from agentrl.train import no_such_name  # noqa: F401
    with pytest.raises(AttributeError):
        importlib.import_module("agentrl.rollout").no_such_name  # noqa: B018
