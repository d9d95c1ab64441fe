"""What every backend shares (`agentrl.sandbox.base`): checked requests, capped output, exit codes,
`with`/`close`, and the same answers from every backend for the same call."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest

from agentrl.sandbox import Capabilities, Limits, Sandbox, SandboxDead, SandboxSpec, open_sandbox
from agentrl.sandbox.base import KILLED, CappedOutput, ExecRequest, ExecResult, SandboxBase, signal_exit

LIMITS = Limits(exec_timeout_s=7.0, output_limit_bytes=100)


def request(cmd="true", **options) -> ExecRequest:
    return ExecRequest.make(cmd, LIMITS, options)


# --- pure pieces, hand-computed --------------------------------------------------------------


def test_capped_output_keeps_the_cap_and_counts_the_rest():
    out = CappedOutput(5)
    out.feed(b"abc")
    out.feed(b"defg")
    out.feed(b"hi")
    assert (bytes(out.data), out.dropped) == (b"abcde", 4)
    assert out.text() == "abcde\n[agentrl: output truncated, 4 bytes dropped]"


def test_capped_output_under_the_cap_has_no_note():
    out = CappedOutput(5)
    out.feed("é".encode())
    assert (out.text(), out.dropped) == ("é", 0)


def test_signal_exit_maps_128_plus_n_to_minus_n_only():
    assert [signal_exit(c) for c in (0, 1, 128, 129, 137, 159, 160, 255)] == [
        0,
        1,
        128,
        -1,
        -9,
        -31,
        160,
        255,
    ]


def test_a_timed_out_result_reads_killed():
    out, err = CappedOutput(10), CappedOutput(10)
    err.feed(b"x" * 12)
    r = ExecResult.captured(0, out, err, timed_out=True, duration_s=1.5)
    assert (r.exit_code, r.timed_out, r.truncated, r.ok) == (KILLED, True, True, False) and KILLED == -9
    assert ExecResult.captured(-15, out, err, timed_out=True, duration_s=1.5).exit_code == -15


def test_request_defaults_come_from_the_limits():
    r = request("echo hi")
    assert (r.argv, r.timeout, r.output_limit, r.identity, r.stdin, dict(r.env)) == (
        ("/bin/sh", "-c", "echo hi"),
        7.0,
        100,
        "agent",
        None,
        {},
    )


def test_request_takes_the_callers_values():
    r = request(["cat", Path("/x")], timeout=2, output_limit=9, stdin="é", env={"A": "1"}, as_verifier=True)
    assert (r.argv, r.timeout, r.output_limit, r.stdin, dict(r.env), r.identity) == (
        ("cat", "/x"),
        2.0,
        9,
        "é".encode(),
        {"A": "1"},
        "verifier",
    )
    assert request(privileged=True).identity == "privileged"


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"cmd": []}, "non-empty list of strings"),
        ({"cmd": ["ls", 3]}, "non-empty list of strings"),
        ({"cmd": b"ls"}, "shell string or a non-empty list"),
        ({"timeout": 0}, "timeout must be > 0"),
        ({"timeout": float("nan")}, "timeout must be > 0"),
        ({"output_limit": 0}, "output_limit must be >= 1"),
        ({"privileged": True, "as_verifier": True}, "two different identities"),
        ({"env": {"A": 1}}, "must be a string"),
    ],
)
def test_a_bad_call_is_refused_with_what_was_wrong(kw, says):
    with pytest.raises(ValueError, match=says):
        request(**kw)


def test_an_unknown_keyword_is_refused_not_ignored():
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['timout'\]"):
        request(timout=3)


# --- every backend, the same answers --------------------------------------------------------

BACKENDS = ["local", "bwrap", pytest.param("docker", marks=pytest.mark.docker)]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    if request.param == "bwrap":
        request.getfixturevalue("bwrap_path")
    return request.param


def opened(backend: str, spec: SandboxSpec | None = None, **fields) -> Sandbox:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # local's "no isolation" warning
        return open_sandbox(backend, spec, **fields)


def test_a_backend_takes_a_spec_and_keeps_it(backend):
    spec = SandboxSpec(
        limits=Limits(memory_mb=256, exec_timeout_s=9), env={"GREETING": "hi"}, labels={"k": "v"}
    )
    with opened(backend, spec) as sb:
        assert isinstance(sb, Sandbox) and isinstance(sb, SandboxBase)
        assert (sb.spec, sb.limits, sb.workdir, sb.backend) == (spec, spec.limits, "/workspace", backend)
        assert isinstance(sb.capabilities, Capabilities)
        assert sb.exec("echo $GREETING").stdout == "hi\n"


def test_keywords_and_a_spec_open_the_same_sandbox(backend):
    with opened(backend, SandboxSpec(env={"A": "1"}), env={"A": "2"}) as sb:
        assert sb.spec == SandboxSpec(env={"A": "2"})
        assert sb.exec("echo $A").stdout == "2\n"


def test_every_backend_answers_a_call_alike(backend):
    with opened(backend, limits=Limits(output_limit_bytes=10, exec_timeout_s=20)) as sb:
        r = sb.exec("printf 0123456789abcdef; echo err >&2; exit 3")
        assert (r.exit_code, r.stdout, r.stderr, r.truncated) == (
            3,
            "0123456789\n[agentrl: output truncated, 6 bytes dropped]",
            "err\n",
            True,
        )
        assert sb.exec("kill -9 $$").exit_code == -9  # a signal is -N on every backend
        slow = sb.exec("sleep 30", timeout=0.5)
        assert (slow.exit_code, slow.timed_out) == (-9, True)
        with pytest.raises(ValueError, match="two different identities"):
            sb.exec("true", privileged=True, as_verifier=True)


def test_close_is_idempotent_and_a_closed_sandbox_says_how_to_go_on(backend):
    with opened(backend) as sb:
        pass
    sb.close()
    assert not sb.alive()
    with pytest.raises(SandboxDead, match=rf"is closed; open a new one with open_sandbox\('{backend}'\)"):
        sb.exec("true")
    with pytest.raises(SandboxDead, match="is closed"):
        sb.read_file("x")


def test_copy_in_of_a_missing_host_path_names_it(backend, tmp_path):
    with (
        opened(backend) as sb,
        pytest.raises(FileNotFoundError, match="no such file or directory on the host"),
    ):
        sb.copy_in(tmp_path / "absent", "x")


def test_a_workspace_deleted_from_outside_is_a_dead_sandbox():
    sb = opened("local")
    try:
        shutil.rmtree(sb.host_workdir)  # type: ignore[attr-defined]
        with pytest.raises(SandboxDead, match="lost its workspace"):
            sb.write_file("a.txt", "x")
    finally:
        sb.close()
