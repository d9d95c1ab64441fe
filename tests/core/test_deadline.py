import pytest

from agentrl.core.deadline import DeadlineExceeded, call_with_deadline


def test_call_with_deadline_hands_back_the_result_or_the_exception_with_its_traceback():
    assert call_with_deadline(sum, [1, 2], timeout_s=5.0) == 3

    def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom") as info:
        call_with_deadline(boom, timeout_s=5.0)
    assert info.traceback[-1].name == "boom"  # raised where it was raised, on the other thread


def test_an_overrunning_call_is_abandoned_with_deadline_exceeded():
    import threading

    release = threading.Event()
    with pytest.raises(DeadlineExceeded, match="slow did not return within 0.2s"):
        call_with_deadline(release.wait, 3600, timeout_s=0.2, name="slow")
    release.set()  # the abandoned thread finishes; its result is dropped
