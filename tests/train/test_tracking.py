"""W&B's mode: `auto` is online only when a key is at hand, for the server this `wandb` talks to."""

from __future__ import annotations

import pytest

from agentrl.train.tracking import wandb_mode


@pytest.fixture
def no_key(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    # A server of this machine's (no outside host named): W&B's own default is read the same way.
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    return tmp_path / "netrc"


def test_an_explicit_mode_is_kept_and_wandb_mode_wins(no_key, monkeypatch):
    assert wandb_mode("offline") == "offline" and wandb_mode("online") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") is None  # W&B reads it itself


def test_auto_is_online_with_a_key_in_the_environment_or_in_netrc_for_this_server(no_key, monkeypatch):
    assert wandb_mode("auto") == "offline"
    no_key.write_text("machine 127.0.0.2 login user password k\n")
    no_key.chmod(0o600)
    assert wandb_mode("auto") == "offline"  # a login for another server
    no_key.write_text("machine 127.0.0.1 login user password k\n")
    assert wandb_mode("auto") == "online"
    no_key.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode("auto") == "online"
