"""`agentrl sandbox doctor`: the diagnosis, and the real CLI run as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.sandbox.doctor import BackendReport, check_bwrap, check_docker, diagnose

REPO = Path(__file__).resolve().parents[2]
AGENTRL = Path(sys.executable).parent / "agentrl"


@pytest.mark.docker
def test_diagnose_reports_every_backend_ok_on_a_set_up_machine(bwrap_path):
    reports = diagnose()
    assert [r.backend for r in reports] == ["docker", "bwrap", "local"]
    assert all(isinstance(r, BackendReport) for r in reports)
    by_name = {r.backend: r for r in reports}
    assert by_name["docker"].ok and "agentrl/base:bookworm" in by_name["docker"].detail
    assert by_name["bwrap"].ok and "bubblewrap" in by_name["bwrap"].detail
    assert by_name["local"].ok and "trusted tests only" in by_name["local"].detail


@pytest.mark.docker
def test_missing_image_says_how_to_build_it():
    report = check_docker("agentrl/no-such-image:never")
    assert not report.ok and "agentrl sandbox build" in report.detail


def test_unreachable_engine_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    report = check_docker()
    assert not report.ok and "no Docker engine answers" in report.detail


def test_bwrap_without_rootfs_or_docker_says_the_fix(bwrap_path, monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache
    monkeypatch.delenv("AGENTRL_BWRAP_ROOTFS", raising=False)
    report = check_bwrap()
    assert not report.ok and "AGENTRL_BWRAP_ROOTFS" in report.detail


def test_bwrap_with_a_bad_rootfs_env_says_so(bwrap_path, monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTRL_BWRAP_ROOTFS", str(tmp_path))
    report = check_bwrap()
    assert not report.ok and "not a root file system" in report.detail


def test_bwrap_missing_binary(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    report = check_bwrap()
    assert not report.ok and "apt-get install bubblewrap" in report.detail


@pytest.mark.docker
def test_cli_prints_one_line_per_backend_and_exits_zero(bwrap_path):
    r = subprocess.run(
        [str(AGENTRL), "sandbox", "doctor"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["[ok]", "docker"], ["[ok]", "bwrap"], ["[ok]", "local"]]


def test_cli_still_answers_when_docker_is_gone(bwrap_path, tmp_path):
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock", "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("AGENTRL_BWRAP_ROOTFS", None)
    r = subprocess.run(
        [str(AGENTRL), "sandbox", "doctor"], capture_output=True, text=True, env=env, timeout=120
    )
    # local always works, so the exit status is 0; docker and bwrap say what is missing.
    assert r.returncode == 0, r.stderr
    assert "[no] docker" in r.stdout and "[no] bwrap" in r.stdout and "[ok] local" in r.stdout
