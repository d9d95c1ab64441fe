"""Sandbox hosts: several Docker engines, one warm pool each, least-loaded placement, reaped after a crash.

The second engine is a real dockerd with its own data root (tests/fixtures_dockerd.py), reached
over TCP on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import docker
import pytest

from agentrl.sandbox.engine import engine_address
from agentrl.sandbox.hosts import DockerHost, HostPool

AGENTRL_CLI = Path(sys.executable).with_name("agentrl")


def run_label(run_id: str) -> str:
    return f"agentrl.run_id={run_id}"


def local_containers(run_id: str) -> list:
    return docker.from_env().containers.list(all=True, filters={"label": run_label(run_id)})


# --- parsing (no engine) ------------------------------------------------------------------


def test_a_host_without_a_scheme_is_refused_with_the_forms_that_work():
    with pytest.raises(ValueError, match=r"no scheme; write it as unix:///path/docker.sock, tcp://host:2376"):
        DockerHost.parse("node2:2376")


def test_a_host_mapping_with_an_unknown_key_is_refused():
    with pytest.raises(ValueError, match=r"unknown keys \['cert'\]"):
        DockerHost.parse({"url": "tcp://node2:2376", "cert": "/x"})


def test_a_host_cert_path_that_is_not_a_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        DockerHost.parse({"url": "tcp://node2:2376", "cert_path": str(tmp_path / "missing")})


def test_the_same_engine_twice_is_refused():
    with pytest.raises(ValueError, match="names an engine twice"):
        HostPool(["tcp://a:2376", "tcp://a:2376"], reap_on_start=False)


def test_a_tls_host_is_reached_through_the_sdks_tls_config(tmp_path):
    # Self-signed client material in the docker CLI's layout; the SDK reads it when the client is made.
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=agentrl-test",
         "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
        check=True, capture_output=True,
    )  # fmt: skip
    (tmp_path / "ca.pem").write_bytes((tmp_path / "cert.pem").read_bytes())
    from agentrl.sandbox.engine import engine_environment, register_tls

    # A loopback address of its own, never connected to: only the client's set-up is checked.
    url = f"tcp://127.0.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250 + 2}:2376"
    HostPool([{"url": url, "cert_path": str(tmp_path)}], reap_on_start=False)
    env = engine_environment(url)
    assert (env["DOCKER_CERT_PATH"], env["DOCKER_TLS_VERIFY"]) == (str(tmp_path), "1")
    api = docker.from_env(version="1.44", environment=env).api  # a fixed version: no call is made
    assert api.base_url == "https://" + url.removeprefix("tcp://")
    assert api.verify == str(tmp_path / "ca.pem")
    assert api.cert == (str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))
    register_tls(url, None, verify=False)  # leave no TLS for that address behind


# --- two real engines -------------------------------------------------------------------------


@pytest.mark.docker
def test_sandboxes_go_to_the_least_loaded_engine(tcp_engine, monkeypatch):
    run_id = f"hosts-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("AGENTRL_RUN_ID", run_id)
    from agentrl.sandbox import reaper

    monkeypatch.setattr(reaper, "_run_ids", {})
    local = engine_address()
    pool = HostPool([local, tcp_engine.address], size=0, reap_on_start=False)
    boxes = [pool.acquire() for _ in range(4)]
    try:
        assert pool.load() == {local: 2, tcp_engine.address: 2}
        # Each engine holds exactly the two it was given, labelled with the run and the engine.
        assert len(local_containers(run_id)) == 2
        remote = tcp_engine.containers(run_label(run_id))
        assert len(remote) == 2
        assert {c.labels["agentrl.engine"] for c in remote} == {tcp_engine.address}
        assert boxes[1].exec("echo hi").stdout == "hi\n"  # the remote one works end to end
        # Free one on the remote engine: the next sandbox goes there.
        next(b for b in boxes if b.docker_host == tcp_engine.address).close()
        extra = pool.acquire()
        boxes.append(extra)
        assert extra.docker_host == tcp_engine.address
        # Released, a sandbox is reset on its own engine and no longer counts as out there.
        given_back = next(b for b in boxes if b.docker_host == local)
        pool.release(given_back)
        assert pool.load()[local] == 1
        deadline = time.monotonic() + 60
        while pool.stats()[local]["pool"].recycled < 1:
            assert time.monotonic() < deadline, pool.stats()
            time.sleep(0.05)
        assert pool.acquire() is given_back  # the least-loaded engine again, its reset container first
    finally:
        for b in boxes:
            b.close()
        pool.close()
    assert local_containers(run_id) == [] and tcp_engine.containers(run_label(run_id)) == []


@pytest.mark.docker
def test_an_engine_that_cannot_start_sandboxes_is_skipped(tcp_engine, monkeypatch):
    monkeypatch.setenv("AGENTRL_RUN_ID", f"hosts-{uuid.uuid4().hex[:8]}")
    pool = HostPool([tcp_engine.address, engine_address()], size=0, reap_on_start=False)
    # An image only the local engine has: the remote engine refuses, the local one serves.
    sb = pool.acquire(image="agentrl/base:bookworm", labels={"x": "1"})
    sb.close()
    with pytest.raises(Exception, match="no docker host could start a sandbox"):
        pool.acquire(image="agentrl/no-such-image:1")
    pool.close()


DRIVER = textwrap.dedent(
    """
    import sys, time
    from agentrl.sandbox.hosts import HostPool
    pool = HostPool(sys.argv[1:], size=1, reap_on_start=False)
    boxes = [pool.acquire() for _ in range(4)]
    pool.prewarm(1)  # warm ones too: they are the pool's, and must not outlive the driver either
    print("READY", pool.load(), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.docker
def test_after_sigkill_of_the_driver_a_reap_leaves_nothing_on_either_engine(tcp_engine):
    run_id = f"hosts-kill-{uuid.uuid4().hex[:8]}"
    local = engine_address()
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, local, tcp_engine.address],
        env={**os.environ, "AGENTRL_RUN_ID": run_id},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), proc.stderr.read() if proc.poll() is not None else line
        assert len(local_containers(run_id)) >= 2 and len(tcp_engine.containers(run_label(run_id))) >= 2
    finally:
        proc.send_signal(signal.SIGKILL)  # no handler runs: only the labels are left to go by
        proc.wait(timeout=30)
    # The CLI, against both engines (the remote one by its TCP address).
    out = subprocess.run(
        [str(AGENTRL_CLI), "sandbox", "reap", "--host", local, "--host", tcp_engine.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"on {tcp_engine.address}" in out.stdout
    assert local_containers(run_id) == []
    assert tcp_engine.containers(run_label(run_id)) == []


@pytest.mark.docker
def test_reap_by_run_removes_that_runs_containers_even_while_its_owner_lives(tcp_engine, monkeypatch):
    from agentrl.sandbox import reaper
    from agentrl.sandbox.docker import DockerSandbox

    run_id = f"hosts-run-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("AGENTRL_RUN_ID", run_id)
    monkeypatch.setattr(reaper, "_run_ids", {})
    sb = DockerSandbox(docker_host=tcp_engine.address)
    try:
        assert reaper.reap(host=tcp_engine.address) == []  # its owner (this process) lives
        assert reaper.reap(host=tcp_engine.address, run=run_id) == [sb.name]
        assert tcp_engine.containers(run_label(run_id)) == []
    finally:
        sb.close()


@pytest.mark.docker
def test_an_environment_places_its_sandbox_on_the_configured_hosts(tcp_engine, monkeypatch):
    import agentrl
    from agentrl.sandbox import hosts
    from agentrl.sandbox.settings import SandboxSettings, configure

    monkeypatch.setenv("AGENTRL_POOL_SIZE", "0")
    monkeypatch.delenv("AGENTRL_DOCKER_HOSTS", raising=False)
    configure(SandboxSettings(docker_hosts=[tcp_engine.address]))  # what `agentrl train` does with sandbox:
    try:
        env = agentrl.make("agentrl/calc-v0", backend="docker")
        try:
            env.reset(seed=0)
            assert env.unwrapped.sandbox.docker_host == tcp_engine.address
        finally:
            env.close()
        pools = hosts.default_host_pool()._pools.values()
        assert [p.size for p in pools] == [0]  # AGENTRL_POOL_SIZE overrides the configured 4
    finally:
        configure(None)
    assert hosts.default_host_pool() is None


@pytest.mark.docker
def test_the_hosts_can_come_from_the_environment_alone(tcp_engine, monkeypatch):
    import agentrl
    from agentrl.sandbox import hosts

    monkeypatch.setenv("AGENTRL_POOL_SIZE", "0")
    monkeypatch.setenv("AGENTRL_DOCKER_HOSTS", tcp_engine.address)
    try:
        env = agentrl.make("agentrl/calc-v0", backend="docker")
        try:
            env.reset(seed=0)
            assert env.unwrapped.sandbox.docker_host == tcp_engine.address
        finally:
            env.close()
    finally:
        monkeypatch.delenv("AGENTRL_DOCKER_HOSTS")
    assert hosts.default_host_pool() is None  # the old hosts' pool is closed


def test_a_bad_docker_host_in_the_config_is_one_line_naming_the_fix():
    from agentrl.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="no scheme; write it as unix:///"):
        load_config(None, ["sandbox.docker_hosts=[node2:2376]"], model="m")
