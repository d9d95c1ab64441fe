"""The gateway's HTTP surface with the official `openai` SDK: completions, streaming, log-probs, stop
strings, tool calls, sessions, and bad input (always an OpenAI-style 4xx, never a 500; the server
keeps serving).

The policy is the transformers reference (`HFPolicy`) on the tiny model: real sampling, no vLLM start.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from agentrl.gateway.server import MAX_BODY_BYTES, Gateway
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy import HFPolicy
from tests import fixtures_model
from tests.gateway.scripted import ToolCallPolicy, guess_call

tiny_model_dir = fixtures_model.tiny_model_dir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "guess",
            "description": "Guess the number.",
            "parameters": {
                "type": "object",
                "properties": {"number": {"type": "integer"}},
                "required": ["number"],
            },
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "Find the number."},
    {"role": "user", "content": "It is in 1..100."},
]
ROLLOUT = RolloutConfig(max_tokens_per_turn=12, max_total_tokens=1024)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tokenizer):
    policy = HFPolicy(tiny_model_dir)
    with Gateway(policy, tokenizer=tokenizer) as gw:
        yield gw


def client(session) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session.url, api_key="unused", max_retries=0)


def run(coro):
    return asyncio.run(coro)


def test_completion_is_the_captured_sample(gateway):
    session = gateway.session(rollout=ROLLOUT, seed=3)

    async def go():
        async with client(session) as c:
            return await c.chat.completions.create(
                model=gateway.model_name, messages=MESSAGES, logprobs=True, max_tokens=8
            )

    r = run(go())
    (choice,) = r.choices
    (sample,) = session.samples
    assert r.model == gateway.model_name and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(sample.forced_ids)
    assert r.usage.completion_tokens == len(sample.sampled_ids) <= 8
    assert choice.message.content == sample.action_text
    content_ids = sample.sampled_ids[: len(choice.logprobs.content)]
    assert [t.logprob for t in choice.logprobs.content] == sample.logprobs[: len(content_ids)]
    decode = gateway.masker_for(None).decode
    assert "".join(decode([i]) for i in content_ids) == "".join(t.token for t in choice.logprobs.content)
    assert r.system_fingerprint == "agentrl-v0"


def test_models_route(gateway):
    session = gateway.session(rollout=ROLLOUT)

    async def go():
        async with client(session) as c:
            listed = await c.models.list()
            one = await c.models.retrieve(gateway.model_name)
            with pytest.raises(openai.NotFoundError):
                await c.models.retrieve("gpt-4o")
            return listed, one

    listed, one = run(go())
    assert [m.id for m in listed.data] == [gateway.model_name] and one.id == gateway.model_name


def test_stream_returns_exactly_the_sampled_text(gateway):
    # Not locked: the request's seed decides, so the streamed and the plain call sample alike.
    session = gateway.session(rollout=ROLLOUT, lock_sampling=False)

    async def go():
        async with client(session) as c:
            plain = await c.chat.completions.create(
                model=gateway.model_name, messages=MESSAGES, seed=11, logprobs=True, n=2
            )
            stream = await c.chat.completions.create(
                model=gateway.model_name,
                messages=MESSAGES,
                seed=11,
                logprobs=True,
                n=2,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            return plain, chunks

    plain, chunks = run(go())
    for i, choice in enumerate(plain.choices):
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        text = "".join(d.delta.content or "" for d in deltas)
        assert text == choice.message.content
        streamed_lps = [t.logprob for d in deltas if d.logprobs for t in d.logprobs.content]
        assert streamed_lps == [t.logprob for t in choice.logprobs.content]
        assert deltas[-1].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert plain.choices[0].message.content != plain.choices[1].message.content  # n draws n samples


def test_stop_string_cuts_text_and_keeps_sampled_ids(gateway):
    session = gateway.session(rollout=ROLLOUT, lock_sampling=False)

    async def go():
        async with client(session) as c:
            free = await c.chat.completions.create(
                model=gateway.model_name, messages=MESSAGES, seed=5, max_tokens=12
            )
            text = free.choices[0].message.content
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            cut = await c.chat.completions.create(
                model=gateway.model_name, messages=MESSAGES, seed=5, max_tokens=12, stop=[stop]
            )
            return text, stop, cut

    text, stop, cut = run(go())
    assert stop and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    first, second = session.samples
    # The kept ids are a prefix of the same sample, up to the id that completed the stop string.
    assert second.sampled_ids == first.sampled_ids[: len(second.sampled_ids)]
    assert stop in gateway.masker_for(None).decode(second.sampled_ids)
    assert stop not in gateway.masker_for(None).decode(second.sampled_ids[:-1])


def test_tool_calls_parsed_and_streamed(tokenizer):
    policy = ToolCallPolicy(tokenizer, lambda _prompt, n: guess_call(50 + n, "Halfway. "))
    with Gateway(policy, tokenizer=tokenizer) as gw:
        session = gw.session(rollout=RolloutConfig(max_tokens_per_turn=64))

        async def go():
            async with client(session) as c:
                plain = await c.chat.completions.create(model=gw.model_name, messages=MESSAGES, tools=TOOLS)
                stream = await c.chat.completions.create(
                    model=gw.model_name, messages=MESSAGES, tools=TOOLS, stream=True, logprobs=True
                )
                chunks = [chunk async for chunk in stream]
                bare = await c.chat.completions.create(
                    model=gw.model_name, messages=MESSAGES, tools=TOOLS, tool_choice="none"
                )
                return plain, chunks, bare

        plain, chunks, bare = run(go())
    msg = plain.choices[0].message
    assert plain.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Halfway."
    (call,) = msg.tool_calls
    assert call.function.name == "guess" and json.loads(call.function.arguments) == {"number": 50}
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [
        ("guess", {"number": 51})
    ]
    # Log-probs on every streamed token, as many as the unstreamed reply's.
    streamed_lps = [t.logprob for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(streamed_lps) == len(session.samples[1].sampled_ids) - 1
    assert streamed_lps == session.samples[1].logprobs[: len(streamed_lps)]
    # Ids as OpenAI's: a new one per call, given once in the stream.
    assert call.id.startswith("call_") and streamed[0].id.startswith("call_") and call.id != streamed[0].id
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice "none": the text comes back whole, nothing parsed.
    assert bare.choices[0].message.tool_calls is None
    assert bare.choices[0].message.content == guess_call(52, "Halfway. ")


def _post(url: str, body: bytes | str, **kw) -> httpx.Response:
    data = body.encode() if isinstance(body, str) else body
    return httpx.post(url, content=data, headers={"content-type": "application/json"}, timeout=60, **kw)


def _ok_body(model: str, **extra) -> str:
    return json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 4, **extra})


def test_bad_input_is_an_openai_4xx_and_the_server_goes_on(gateway, tiny_model_dir, tokenizer):
    session = gateway.session(rollout=ROLLOUT)
    url = f"{session.url}/chat/completions"
    model = gateway.model_name
    cases = {
        "malformed JSON": (b'{"model": "x", "messages": [', 400),
        "not an object": ("[1, 2, 3]", 400),
        "unknown field": (_ok_body(model, reward=1.0), 400),
        "unknown message field": (
            json.dumps({"model": model, "messages": [{"role": "user", "content": "hi", "reward": 1}]}),
            400,
        ),
        "no messages": (json.dumps({"model": model, "messages": []}), 400),
        "unknown role": (json.dumps({"model": model, "messages": [{"role": "judge", "content": "1"}]}), 400),
        "image content": (
            json.dumps(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}],
                }
            ),
            400,
        ),
        "audio content": (
            json.dumps(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
                }
            ),
            400,
        ),
        "max_tokens above the session's limit": (_ok_body(model, max_tokens=100_000), 400),
        "wrong model": (_ok_body("gpt-4o"), 404),
        "n too large": (_ok_body(model, n=gateway.max_n + 1), 400),
        "n zero": (_ok_body(model, n=0), 400),
        "temperature out of range": (_ok_body(model, temperature=7), 400),
        "logit bias": (_ok_body(model, logit_bias={"5": 100}), 400),
        "penalty": (_ok_body(model, presence_penalty=1.5), 400),
        "top logprobs": (_ok_body(model, logprobs=True, top_logprobs=5), 400),
        "json mode": (_ok_body(model, response_format={"type": "json_object"}), 400),
        "unknown tool choice": (
            _ok_body(model, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rm"}}),
            400,
        ),
        "too many stops": (_ok_body(model, stop=["a", "b", "c", "d", "e"]), 400),
        "huge body": (b" " * (MAX_BODY_BYTES + 1), 413),
    }
    for name, (body, status) in cases.items():
        r = _post(url, body)
        assert r.status_code == status, (name, r.status_code, r.text)
        if "content" in name:
            assert "text only" in r.json()["error"]["message"], name
        if "limit" in name:
            assert f"limit of {ROLLOUT.max_tokens_per_turn} tokens" in r.json()["error"]["message"]
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], name
        assert "Traceback" not in r.text, name
    # Tokens that are not this session's: unknown, of another gateway (another run), and a path without one.
    with Gateway(HFPolicy(tiny_model_dir), tokenizer=tokenizer) as other:
        foreign = other.session(rollout=ROLLOUT)
        for wrong in (
            f"{gateway.url}/s/{foreign.token}/v1/chat/completions",
            f"{gateway.url}/s/{session.token[:-1]}x/v1/chat/completions",
            f"{gateway.url}/v1/chat/completions",
        ):
            r = _post(wrong, _ok_body(model))
            assert r.status_code == 404 and r.json()["error"]["message"], wrong
        assert not foreign.samples and not session.samples  # nothing reached either session's record
    assert httpx.get(url, timeout=30).status_code == 405
    # Still serving, and the session still works.
    r = _post(url, _ok_body(model))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    # A finished session answers 404 in OpenAI's shape, through the SDK as well.
    session.close("submitted")

    async def go():
        async with client(session) as c:
            with pytest.raises(openai.NotFoundError) as info:
                await c.chat.completions.create(model=model, messages=MESSAGES)
            return info.value

    assert run(go()).code == "session_not_found"


def test_nothing_an_agent_sends_changes_the_policy(gateway):
    """The routes there are: a session's completions and models. Any other path, method or field is refused
    and leaves the session's record and the engine's version as they were."""
    session = gateway.session(rollout=ROLLOUT)
    version = gateway.policy.version
    base = session.url
    for method, path, body in [
        ("POST", "/rl/set_reward", {"reward": 1.0}),
        ("POST", "/reward", {"reward": 1.0}),
        ("POST", "/weights", {}),
        ("PUT", "/chat/completions", {}),
        ("DELETE", "/models/agentrl-policy", {}),
        ("POST", "/../../s", {}),
    ]:
        r = httpx.request(method, base + path, json=body, timeout=30)
        assert 400 <= r.status_code < 500 and "error" in r.json(), (method, path, r.status_code)
    assert not session.samples and not session.closed
    assert gateway.policy.version == version


def test_serve_writes_each_sessions_calls(tiny_model_dir, tokenizer, tmp_path):
    """`agentrl gateway`'s loop: session URLs printed, the calls written as trajectories when it stops."""
    import threading

    from agentrl.gateway.serve import serve
    from agentrl.rollout.trajectory import load_trajectories

    policy = HFPolicy(tiny_model_dir)
    policy.tokenizer = tokenizer
    lines: list[str] = []
    stop = threading.Event()
    out = tmp_path / "calls.jsonl"

    def agent() -> None:
        while len(lines) < 2:
            stop.wait(0.05)
        for line in lines:
            url = json.loads(line)["url"]
            with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as c:
                c.chat.completions.create(
                    model="agentrl-policy", messages=MESSAGES, temperature=0, max_tokens=4
                )
        stop.set()

    worker = threading.Thread(target=agent)
    worker.start()
    notes: list[str] = []

    def note(message: str) -> None:
        notes.append(message)
        if len(notes) == 1:  # said before anything is written
            assert not out.exists()

    written = serve(
        policy, rollout=ROLLOUT, sessions=2, port=0, out=out, echo=lines.append, stop=stop, note=note
    )
    worker.join()
    assert (
        str(out) in notes[0] and "2 completions" in notes[0] and f"wrote 2 trajectories to {out}" in notes[1]
    )
    trajs = load_trajectories(out)
    assert written == len(trajs) == 2
    assert [t.task_id for t in trajs] == ["session-0", "session-1"]
    # temperature 0 was honoured (a served session is not locked): both greedy samples are the same.
    assert trajs[0].token_ids == trajs[1].token_ids and all(t.num_action_tokens == 4 for t in trajs)


def test_unix_socket(tiny_model_dir, tokenizer, tmp_path):
    sock = tmp_path / "gateway.sock"
    with Gateway(HFPolicy(tiny_model_dir), tokenizer=tokenizer, uds=sock) as gw:
        session = gw.session(rollout=ROLLOUT)
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=60)
        with openai.OpenAI(base_url=session.url, api_key="unused", http_client=http, max_retries=0) as c:
            r = c.chat.completions.create(model=gw.model_name, messages=MESSAGES, max_tokens=3)
        assert r.usage.completion_tokens <= 3 and len(session.samples) == 1
    assert not sock.exists()
