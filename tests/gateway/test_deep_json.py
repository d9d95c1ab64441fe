"""A request body nested past what the JSON parser can take is the client's error: a 400 that says so,
never the 500 of a RecursionError."""

from __future__ import annotations

import json

import pytest

from agentrl.gateway.protocol import GatewayError, parse_request


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000],
    ids=["arrays", "objects"],
)
def test_a_body_nested_100000_deep_is_a_400(body):
    with pytest.raises(GatewayError) as info:
        parse_request(body)
    assert info.value.status == 400 and "nested too deeply" in str(info.value)


def test_deep_but_parseable_nesting_in_a_field_is_a_400_too():
    deep = json.loads("[" * 900 + "]" * 900)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": deep})
    with pytest.raises(GatewayError) as info:
        parse_request(body.encode())
    assert info.value.status == 400
