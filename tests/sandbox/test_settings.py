"""Sandbox settings: typed fields, environment variables as overrides read in one place, and what reads them."""

from __future__ import annotations

import pytest

from agentrl.core.errors import UserError
from agentrl.sandbox import pool as pool_module
from agentrl.sandbox.engine import engine
from agentrl.sandbox.settings import (
    ENV_OVERRIDES,
    SandboxSettings,
    SandboxSettingsError,
    configure,
    current,
)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No override from the shell running the tests, and no configured settings left behind."""
    for var in ENV_OVERRIDES.values():
        monkeypatch.delenv(var, raising=False)
    configure(None)
    yield
    configure(None)


def test_defaults_without_overrides():
    s = current()
    assert (s.docker_hosts, s.pool_size, s.pool_workers) == ([], 4, 2)
    assert (s.docker_timeout_s, s.docker_max_lifecycle_calls) == (60.0, 4)


@pytest.mark.parametrize(
    ("var", "raw", "field", "value"),
    [
        ("AGENTRL_POOL_SIZE", "0", "pool_size", 0),
        ("AGENTRL_POOL_WORKERS", "3", "pool_workers", 3),
        ("AGENTRL_DOCKER_TIMEOUT_S", "2.5", "docker_timeout_s", 2.5),
        ("AGENTRL_DOCKER_MAX_LIFECYCLE_CALLS", "2", "docker_max_lifecycle_calls", 2),
        (
            "AGENTRL_DOCKER_HOSTS",
            "tcp://a:2376, unix:///x.sock",
            "docker_hosts",
            ["tcp://a:2376", "unix:///x.sock"],
        ),
    ],
)
def test_each_variable_overrides_its_field_over_the_configured_value(monkeypatch, var, raw, field, value):
    assert ENV_OVERRIDES[field] == var
    configured = SandboxSettings(
        pool_size=7, pool_workers=5, docker_timeout_s=9, docker_max_lifecycle_calls=8
    )
    configure(configured)
    monkeypatch.setenv(var, raw)
    assert getattr(current(), field) == value
    monkeypatch.setenv(var, "")  # empty: not set
    assert current() == configured


def test_the_configured_settings_hold_where_nothing_overrides_them():
    configure(SandboxSettings(pool_size=7, docker_timeout_s=9))
    assert (current().pool_size, current().docker_timeout_s, current().pool_workers) == (7, 9.0, 2)
    configure(None)
    assert current().pool_size == 4


@pytest.mark.parametrize(
    ("var", "raw", "said"),
    [
        ("AGENTRL_POOL_SIZE", "many", "AGENTRL_POOL_SIZE='many': input should be a valid integer"),
        ("AGENTRL_POOL_SIZE", "-1", "AGENTRL_POOL_SIZE='-1': input should be greater than or equal to 0"),
        ("AGENTRL_DOCKER_TIMEOUT_S", "0", "AGENTRL_DOCKER_TIMEOUT_S='0': input should be greater than 0"),
        (
            "AGENTRL_DOCKER_HOSTS",
            "node2:2376",
            "from AGENTRL_DOCKER_HOSTS: docker host 'node2:2376' has no scheme",
        ),
    ],
)
def test_a_bad_override_is_one_line_naming_the_variable(monkeypatch, var, raw, said):
    monkeypatch.setenv(var, raw)
    with pytest.raises(SandboxSettingsError, match=said) as caught:
        current()
    assert isinstance(caught.value, UserError) and "\n" not in str(caught.value)
    # A run finds out when it configures its settings, before its first episode.
    with pytest.raises(SandboxSettingsError, match=said):
        configure(SandboxSettings())


def test_the_train_config_section_is_this_model_and_records_the_file_not_the_overrides(monkeypatch):
    from agentrl.train.config import ConfigError, TrainConfig, load_config

    assert TrainConfig.model_fields["sandbox"].annotation is SandboxSettings
    monkeypatch.setenv("AGENTRL_POOL_SIZE", "9")
    cfg = load_config(None, ["sandbox.pool_size=2", "sandbox.docker_timeout_s=5"], model="m")
    assert (cfg.sandbox.pool_size, cfg.sandbox.docker_timeout_s) == (2, 5.0)  # a resume compares this
    configure(cfg.sandbox)
    assert (current().pool_size, current().docker_timeout_s) == (9, 5.0)
    with pytest.raises(ConfigError, match=r"unknown key 'sandbox.pool'. Did you mean 'sandbox.pool_size'"):
        load_config(None, ["sandbox.pool=2"], model="m")


@pytest.mark.docker
def test_the_docker_engine_client_takes_its_timeout_and_gate_from_the_settings(monkeypatch):
    monkeypatch.setenv("AGENTRL_DOCKER_TIMEOUT_S", "3")
    configure(SandboxSettings(docker_max_lifecycle_calls=2))
    eng = engine()
    assert eng.timeout_s == 3.0 and eng.stats().limit == 2


def test_the_default_pool_takes_its_size_from_the_settings():
    old = pool_module.get_default_pool()
    old.close()
    configure(SandboxSettings(pool_size=1, pool_workers=3))
    pool = pool_module.get_default_pool()
    try:
        assert pool is not old and (pool.size, pool.workers) == (1, 3)
    finally:
        pool.close()
