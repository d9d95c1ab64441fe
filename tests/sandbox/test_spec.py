"""`SandboxSpec` and `Capabilities`: the settings of a sandbox declared, defaulted and checked once."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from agentrl.sandbox import (
    DEFAULT_IMAGE,
    DEFAULT_WORKDIR,
    Capabilities,
    Limits,
    SandboxSpec,
    backend_capabilities,
    capabilities_of,
)


def test_defaults_are_the_documented_ones():
    spec = SandboxSpec()
    assert (spec.image, spec.workdir, spec.limits, dict(spec.env), dict(spec.labels)) == (
        DEFAULT_IMAGE,
        DEFAULT_WORKDIR,
        Limits(),
        {},
        {},
    )


def test_equal_specs_hash_alike_whatever_the_mapping_order():
    a = SandboxSpec(env={"A": "1", "B": "2"}, labels={"x": "y"})
    b = SandboxSpec(env={"B": "2", "A": "1"}, labels={"x": "y"})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != SandboxSpec(env={"A": "1"}, labels={"x": "y"})


def test_env_and_labels_cannot_be_changed_in_place():
    spec = SandboxSpec(env={"A": "1"})
    with pytest.raises(TypeError):
        spec.env["A"] = "2"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.image = "other"  # type: ignore[misc]


def test_a_spec_survives_pickling():
    spec = SandboxSpec(image="img", limits=Limits(memory_mb=256), env={"A": "1"}, labels={"k": "v"})
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_workdir_is_normalised():
    assert SandboxSpec(workdir="/home/agent/../agent/work/").workdir == "/home/agent/work"
    assert SandboxSpec(workdir="//workspace").workdir == "/workspace"


@pytest.mark.parametrize(
    ("workdir", "says"),
    [
        ("relative", "must be an absolute sandbox path"),
        ("/", "is the root"),
        ("/tmp", "is /tmp;"),
        ("/tmp/ws", "inside /tmp"),
        ("/verifier", "is /verifier;"),
        ("/verifier/ws", "inside /verifier"),
        ("/proc/self", "inside /proc"),
        ("/workspace/../dev/shm", "inside /dev"),
    ],
)
def test_a_workdir_that_cannot_be_a_workspace_is_refused(workdir, says):
    with pytest.raises(ValueError, match=says):
        SandboxSpec(workdir=workdir)


def test_limits_may_be_given_as_a_mapping():
    assert SandboxSpec(limits={"memory_mb": 256}).limits == Limits(memory_mb=256)
    with pytest.raises(ValueError, match="limits must be a Limits"):
        SandboxSpec(limits=512)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("image", "", "image must be a non-empty image name"),
        ("env", {"A=B": "1"}, "env has an invalid name 'A=B'"),
        ("env", {"A": 1}, r"env\['A'\] must be a string"),
        ("labels", {"k": "a\0b"}, r"labels\['k'\] must be a string without NUL"),
        ("labels", ["k"], "labels must be a mapping"),
    ],
)
def test_bad_fields_are_refused_with_what_was_wrong(field, value, says):
    with pytest.raises(ValueError, match=says):
        SandboxSpec(**{field: value})


def test_of_fills_a_spec_from_keywords_and_none_keeps_the_default():
    assert SandboxSpec.of(image="img", limits=None, env=None) == SandboxSpec(image="img")
    base = SandboxSpec(image="img", env={"A": "1"})
    assert SandboxSpec.of(base) is base
    assert SandboxSpec.of(base, workdir="/w") == SandboxSpec(image="img", env={"A": "1"}, workdir="/w")
    with pytest.raises(TypeError, match=r"unknown sandbox setting\(s\) \['imag'\]"):
        SandboxSpec.of(imag="img")


def test_capabilities_say_what_is_lacking_and_refuse_unknown_names():
    caps = Capabilities(isolated=True, protected_dir=True)
    assert caps.lacking("isolated", "verifier_identity", "protected_dir") == ("verifier_identity",)
    assert caps.lacking() == ()
    with pytest.raises(ValueError, match="unknown sandbox capabilities"):
        caps.lacking("isolation")


def test_something_that_declares_no_capabilities_has_none():
    class Bare:
        capabilities = frozenset({"isolated"})  # not a Capabilities: promises nothing

    assert capabilities_of(object()) == Capabilities()
    assert capabilities_of(Bare()) == Capabilities()


def test_each_backend_promises_what_its_module_documents():
    docker, bwrap, local = (backend_capabilities(b) for b in ("docker", "bwrap", "local"))
    assert docker.lacking(*(f.name for f in dataclasses.fields(Capabilities))) == ()  # every one
    # One uid (no separate users); each exec is its own pid namespace (no background processes); its
    # root is an exported file system (no engine images); its processes are this one's children, on
    # this machine (nothing outlives it, no placement on other engines).
    assert bwrap == dataclasses.replace(
        docker,
        separate_users=False,
        background_processes=False,
        engine_images=False,
        outlives_process=False,
        host_placement=False,
    )
    # No isolation of any kind; processes live until close().
    assert local == Capabilities(background_processes=True)
