"""A session-wide tiny Qwen2 model directory, for any test that needs a real checkpoint.

Import the fixture into a test module (`from tests.fixtures_model import tiny_model_dir`). It is built
once per session under pytest's base temp dir; `init_tiny` is idempotent, so every module that asks gets
the same directory without a second build.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.kit.tiny_model import init_tiny


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.getbasetemp() / "tiny-qwen2", seed=0)
