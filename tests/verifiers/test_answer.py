import pytest

from agentrl.core.episode import Episode, ToolCallRecord
from agentrl.core.task import Task
from agentrl.verifiers import get, names
from agentrl.verifiers.answer import normalize_text, parse_number


def ep(submission, **kw):
    e = Episode(
        task_id="t",
        submission=submission,
        finish_reason="submitted" if submission is not None else "max_turns",
    )
    for k, v in kw.items():
        setattr(e, k, v)
    return e


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", 42.0),
        ("1,234.5", 1234.5),
        ("-3/4", -0.75),
        ("12%", 0.12),
        ("$42", 42.0),
        ("2e3", 2000.0),
        ("the answer is 7.", 7.0),
        ("−5", -5.0),
        ("no number", None),
        ("1/0", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_normalize_text():
    assert normalize_text('  "Hello   World." ') == "hello world"
    assert normalize_text("Hello", case_sensitive=True) == "Hello"


def test_exact_match():
    v = get("exact-match")
    t = Task(id="t", prompt="p", answer="Paris")
    assert v.verify(None, t, ep("paris.")).passed
    assert not v.verify(None, t, ep("Lyon")).passed
    assert get("exact-match", case_sensitive=True).verify(None, t, ep("paris")).reward == 0.0


def test_numeric_tolerance_and_missing_submission():
    t = Task(id="t", prompt="p", answer="100")
    assert get("numeric").verify(None, t, ep("100.0000001")).passed
    assert not get("numeric").verify(None, t, ep("101")).passed
    assert get("numeric", rel_tol=0.02).verify(None, t, ep("101")).passed
    v = get("numeric").verify(None, t, ep(None))
    assert v.reward == 0 and "nothing submitted" in v.details
    v = get("numeric").verify(None, Task(id="t", prompt="p"), ep("1"))
    assert v.reward == 0 and "no reference answer" in v.details


def test_regex():
    t = Task(id="t", prompt="p", answer=r"\d{3}-\d{4}")
    assert get("regex").verify(None, t, ep(" 555-1234 ")).passed
    assert not get("regex").verify(None, t, ep("call 555-1234")).passed


def test_composite_gate_and_weights():
    t = Task(id="t", prompt="p", answer="10")
    comp = get("composite", parts=[("numeric", 3.0), ("exact-match", 1.0)], gates=["tool-used"])
    assert comp.verify(None, t, ep("10", calls=[ToolCallRecord("python", "ran")])).reward == 1.0
    gated = comp.verify(None, t, ep("10", calls=[]))
    assert gated.reward == 0.0 and "gate tool-used: FAIL" in gated.details
    half = get("composite", parts=[("numeric", 1.0), ("exact-match", 1.0)])
    v = half.verify(None, t, ep("10.0"))  # numeric passes, exact text differs
    assert v.reward == pytest.approx(0.5) and not v.passed
    with pytest.raises(ValueError, match="at least one part"):
        get("composite")


def test_tool_used_gate_counts_only_calls_that_ran():
    gate = get("tool-used", tool="python")
    refused = [
        ToolCallRecord("python", "invalid_arguments", is_error=True),
        ToolCallRecord("python", "not_run"),
    ]
    v = gate.verify(None, Task(id="t", prompt="p"), ep("10", calls=refused))
    assert not v.passed and "python ran 0 time(s) (2 more attempted that did not run)" in v.details
    ran = [*refused, ToolCallRecord("python", "ran", is_error=True)]  # ran, even if its code then failed
    assert gate.verify(None, Task(id="t", prompt="p"), ep("10", calls=ran)).passed


def test_registry_lists_builtins_and_suggests():
    assert {"exact-match", "numeric", "regex", "state", "composite", "tool-used", "auto"} <= set(names())
    with pytest.raises(KeyError, match="Did you mean 'numeric'"):
        get("numerc")
