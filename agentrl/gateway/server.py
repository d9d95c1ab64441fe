"""`Gateway`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of a policy engine.

    with Gateway(policy).start() as gateway:
        session = gateway.session(rollout=RolloutConfig(), seed=0)
        client = openai.AsyncOpenAI(base_url=session.url, api_key="unused")
        await client.chat.completions.create(model=gateway.model_name, messages=[...], tools=[...])
        session.close("submitted"); session.branches()      # token-exact trajectories

Routes, each under one session's base URL `/s/<token>/v1` (the token is 192 random bits, the only
way to a session; nothing else is served):

- `POST /chat/completions`: tools, tool_choice, parallel_tool_calls, n, temperature, top_p, max_tokens,
  max_completion_tokens, stop, seed, logprobs, stream (with `stream_options.include_usage`);
- `POST /responses` (the Responses API) and `POST /messages` (Anthropic's Messages API), translated to
  the same request (`agentrl.gateway.dialects`);
- `GET /models`, `GET /models/{id}`: the one model served (`model_name`), which also answers to its
  `aliases` (the names an agent hard-codes).

Every parameter per dialect, and what each unsupported one returns: docs/AGENTS.md.

Prompts are rendered by the tokenizer's own chat template (`agentrl.rollout.masker.ChatMasker`, the
native loop's renderer), tool calls parsed from the sampled text by the session's format
(`agentrl.env.parsers`). What an agent sends can do nothing but ask for completions in its own
session: there is no route that sets a reward, opens, lists or closes sessions, or touches weights.
Every error is OpenAI's error JSON with a 4xx status; an unexpected failure is a 500 with the same
JSON and no traceback, and the server goes on serving.

Streaming speaks OpenAI's server-sent events; the chunks are written once the engine has finished
the sample (the policy API returns whole samples), and their text adds up to exactly the
non-streamed content.

The server runs on a thread of its own with its own event loop, so the rollout's loop (where harness
agents run) and the server never block each other; `shared_gateway(policy, masker)` is the one a
rollout uses for a policy, started on first use.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from agentrl.env.parsers import get_parser
from agentrl.gateway import dialects
from agentrl.gateway.protocol import GatewayError, parse_request, session_not_found
from agentrl.gateway.session import Completion, Session, ToolsPrompt, count_metrics, text_pieces
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.masker import ChatMasker

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "agentrl-policy"
# A request body larger than this is refused before it is read whole (a conversation of a few
# thousand tokens is tens of kilobytes).
MAX_BODY_BYTES = 16 * 1024 * 1024
# Chat templates rendered with distinct tool lists, kept per gateway (one per environment in practice).
_MASKER_CACHE_SIZE = 64


class Gateway:
    """The OpenAI-compatible server over `policy` (see the module docstring).

    tokenizer: the checkpoint's tokenizer (default: `policy.tokenizer`); chat_template and
        template_kwargs: as `ChatMasker`'s (a rollout passes its masker's, so both render alike).
    model_name: the model id clients must name; aliases: other names it answers to. parser: the default tool-call format of sessions.
    host, port: where to listen (port 0: a free port); uds: a unix socket path instead.
    max_n: the most choices one request may ask for. tools_prompt: how sessions show a request's tools to
        the model by default: "system" writes them into the system message with the session's tool-call
        format, as a native environment does (`tools_in_prompt`), so that a policy trained natively sees
        the prompt it knows; "template" passes them to the chat template's `tools`.
    """

    def __init__(
        self,
        policy: Any,
        *,
        tokenizer: Any = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
        aliases: Iterable[str] = (),
        parser: str = "hermes",
        host: str = "127.0.0.1",
        port: int = 0,
        uds: str | os.PathLike[str] | None = None,
        max_n: int = 8,
        tools_prompt: ToolsPrompt = "system",
    ):
        self.policy = policy
        self.tokenizer = tokenizer if tokenizer is not None else getattr(policy, "tokenizer", None)
        if self.tokenizer is None:
            raise ValueError(
                f"{type(policy).__name__} has no `tokenizer`; pass Gateway(policy, tokenizer=...) (the checkpoint's "
                "tokenizer, whose chat template renders the prompts)"
            )
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        self.model_name = model_name
        self.aliases: set[str] = set(aliases)
        """Other model names requests may ask for (a set: a rollout's harness envs add theirs)."""
        self.parser = get_parser(parser)
        self.host, self.port, self.uds = host, port, None if uds is None else os.fspath(uds)
        self.max_n = max_n
        if tools_prompt not in ("system", "template"):
            raise ValueError(f"tools_prompt must be 'system' or 'template', got {tools_prompt!r}")
        self.tools_prompt: ToolsPrompt = tools_prompt
        self._sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        self._maskers: collections.OrderedDict[str, ChatMasker] = collections.OrderedDict()
        self._maskers_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_error: BaseException | None = None
        self.url = ""
        self.app = _build_app(self)
        # Built once here, on the caller's thread: a template the masker cannot use fails now, not per call.
        self.masker_for(None)

    # --- lifecycle ------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> Gateway:
        """Listen and serve on a background thread; returns once the server accepts connections."""
        if self._thread is not None:
            return self
        import uvicorn

        if self.uds is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.uds)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(self.uds)
            os.chmod(self.uds, 0o666)  # a sandbox user other than ours connects through a mount
            self.url = "http://gateway"
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            self.port = sock.getsockname()[1]
            host = f"[{self.host}]" if ":" in self.host else self.host
            self.url = f"http://{host}:{self.port}"
        sock.listen(4096)
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,  # session tokens are in the paths: never log them
            lifespan="off",
            timeout_keep_alive=300,  # a harness may think for minutes between two calls
            timeout_graceful_shutdown=2,  # stopping does not wait on harnesses' idle connections
            backlog=4096,
        )
        self._server = uvicorn.Server(config)

        def main() -> None:
            async def serve() -> None:
                self._loop = asyncio.get_running_loop()
                await self._server.serve(sockets=[sock])

            try:
                asyncio.run(serve())
            except BaseException as exc:  # reported by start(), or logged once it has returned
                self._start_error = exc
                log.error("the gateway server stopped: %s", exc)

        self._thread = threading.Thread(target=main, name="agentrl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the gateway did not start listening on {self.url}: {self._start_error}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving; every open session is closed (its later calls could not be answered)."""
        with self._sessions_lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            s.close("env_error", "the gateway stopped")
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = None
        if self.uds is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.uds)

    def connect(self) -> socket.socket:
        """A new connection to this server: where a sandbox's relay (`agentrl.gateway.relay`) carries
        each connection its harness command opens, and nowhere else."""
        if self.uds is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.uds)
            except OSError:
                sock.close()
                raise
            return sock
        sock = socket.create_connection((self.host, self.port), timeout=10)
        sock.settimeout(None)
        return sock

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serves(self, model: str) -> bool:
        """Whether a request for `model` is answered: the model's name or one of its aliases."""
        return model == self.model_name or model in self.aliases

    # --- sessions --------------------------------------------------------------------------------------

    def session(
        self,
        *,
        rollout: RolloutConfig | None = None,
        seed: int | None = None,
        index: int = 0,
        max_calls: int | None = None,
        parser: Any = None,
        lock_sampling: bool = True,
        group_id: str = "",
        on_close: Callable[[Session], None] | None = None,
        policy: Any = None,
        tools_prompt: ToolsPrompt | None = None,
    ) -> Session:
        """Open one episode's session; its `url` is the base URL its harness gets.

        rollout: sampling and limits (default `RolloutConfig()`); seed, index: the rollout's random stream and
        the episode's index in it (the native loop's per-turn seeds; None: unseeded). max_calls: the most
        completions it serves (past it the session ends `max_turns`). parser: its tool-call format (a name or
        a parser; default the gateway's). lock_sampling: the rollout's temperature, top-p and seeds whatever
        the request asks (see `agentrl.gateway.session`). on_close: called once when the session ends.
        policy: the policy that samples this session's completions (default: the gateway's; a scripted one
        plays demonstrations through a harness, `agentrl.kit.demonstrations`).
        tools_prompt: how its requests' tools reach the model (default: the gateway's `tools_prompt`).
        """
        if self._thread is None:
            raise RuntimeError("start the gateway (Gateway(...).start()) before opening sessions")
        token = secrets.token_urlsafe(24)
        fmt = self.parser if parser is None else get_parser(parser) if isinstance(parser, str) else parser
        s = Session(
            self,
            token,
            rollout=rollout or RolloutConfig(),
            seed=seed,
            index=index,
            max_calls=max_calls,
            parser=fmt,
            lock_sampling=lock_sampling,
            group_id=group_id,
            on_close=on_close,
            policy=policy,
            tools_prompt=tools_prompt or self.tools_prompt,
        )
        with self._sessions_lock:
            self._sessions[token] = s
        count_metrics(sessions=1)
        return s

    def forget(self, token: str) -> None:
        """Stop serving the session `token` (it is closed): its URL answers 404 from now on."""
        with self._sessions_lock:
            self._sessions.pop(token, None)

    def _lookup(self, token: str) -> Session:
        with self._sessions_lock:
            s = self._sessions.get(token)
        if s is None or s.closed:
            raise session_not_found()
        return s

    @property
    def open_sessions(self) -> int:
        with self._sessions_lock:
            return len(self._sessions)

    def masker_for(self, tools: list[dict[str, Any]] | None) -> ChatMasker:
        """The renderer of conversations offered `tools` (the request's own dicts, passed to the template)."""
        key = json.dumps(tools, sort_keys=False) if tools else ""
        with self._maskers_lock:
            masker = self._maskers.get(key)
            if masker is not None:
                self._maskers.move_to_end(key)
                return masker
        masker = ChatMasker(
            self.tokenizer, self.chat_template, tools=tools or None, template_kwargs=self.template_kwargs
        )
        with self._maskers_lock:
            self._maskers[key] = masker
            while len(self._maskers) > _MASKER_CACHE_SIZE:
                self._maskers.popitem(last=False)
        return masker


# --- HTTP ---------------------------------------------------------------------------------------------


def _error(exc: GatewayError) -> Any:
    return JSONResponse(exc.body(), status_code=exc.status)


def _build_app(gateway: Gateway) -> Any:
    """The gateway's HTTP app: OpenAI's errors for everything that goes wrong, and under each session's
    `/s/<token>/` its models, the Chat Completions and Responses APIs, and Anthropic's Messages API."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    _add_model_routes(app, gateway)
    _add_openai_routes(app, gateway)
    _add_anthropic_routes(app, gateway)
    return app


def _add_error_handlers(app: Any) -> None:
    """Every failure answered in OpenAI's error shape: a route that does not exist, a body that does not
    parse, and a bug of ours (logged here, named by its type only there)."""

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Any:
        if exc.status_code == 404:
            message = (
                "Not found: the gateway serves only /s/<session token>/v1/chat/completions, /responses, /messages "
                "and /models."
            )
        else:
            message = str(exc.detail)
        code = "not_found" if exc.status_code == 404 else None
        return _error(GatewayError(exc.status_code, message, code=code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> Any:
        return _error(GatewayError(400, f"Invalid request: {exc.errors()[0].get('msg', '')}"))

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> Any:
        log.exception("the gateway failed on a request")
        body = GatewayError(
            500,
            f"The gateway failed on this request ({type(exc).__name__}); it is logged on the server.",
            type="server_error",
        ).body()
        return JSONResponse(body, status_code=500)


def _add_model_routes(app: Any, gateway: Gateway) -> None:
    """`GET /models` and `/models/<name>`: the one model a session serves (and its aliases)."""

    def model_card() -> dict[str, Any]:
        return {"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}

    @app.get("/s/{token}/v1/models")
    async def models(token: str) -> Any:
        try:
            gateway._lookup(token)
        except GatewayError as exc:
            return _error(exc)
        return {"object": "list", "data": [model_card()]}

    @app.get("/s/{token}/v1/models/{model:path}")
    async def model(token: str, model: str) -> Any:
        try:
            gateway._lookup(token)
            if not gateway.serves(model):
                raise _no_model(model, gateway.model_name)
        except GatewayError as exc:
            return _error(exc)
        return model_card()


def _add_openai_routes(app: Any, gateway: Gateway) -> None:
    """OpenAI's Chat Completions and Responses APIs, plain or streamed."""

    @app.post("/s/{token}/v1/chat/completions")
    async def chat_completions(token: str, request: Request) -> Any:
        try:
            session = gateway._lookup(token)
            raw = await _read_body(request)
            req, data = parse_request(raw)
            if not gateway.serves(req.model):
                raise _no_model(req.model, gateway.model_name)
            if req.n > gateway.max_n:
                raise GatewayError(400, f"'n' must be at most {gateway.max_n}, got {req.n}.", param="n")
            raw_tools = data.get("tools") or None
            completion = await session.complete(req, raw_tools)
        except GatewayError as exc:
            if exc.status >= 500:
                log.warning("gateway request failed: %s (%r)", exc.message, exc.__cause__)
            return _error(exc)
        decode = session.gateway.masker_for(None).decode
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _sse(completion, gateway.model_name, bool(req.logprobs), include_usage, decode),
                media_type="text/event-stream",
            )
        return _completion_json(completion, gateway.model_name, bool(req.logprobs), decode)

    @app.post("/s/{token}/v1/responses")
    async def responses(token: str, request: Request) -> Any:
        try:
            session = gateway._lookup(token)
            req = dialects.parse_responses(await _read_body(request), session.response_history)
            if not gateway.serves(req.chat.model):
                raise _no_model(req.chat.model, gateway.model_name)
            completion = await session.complete(req.chat, req.tools)
        except GatewayError as exc:
            if exc.status >= 500:
                log.warning("gateway request failed: %s (%r)", exc.message, exc.__cause__)
            return _error(exc)
        decode = gateway.masker_for(None).decode
        rid = dialects.response_id()
        ch = completion.choices[0]
        # What a later `previous_response_id` continues: this request's conversation (its instructions
        # are not carried over, as OpenAI's are not) and the reply.
        asked = [m.model_dump(exclude_none=True) for m in req.chat.messages]
        session.remember_response(rid, asked[1:] if req.data.get("instructions") else asked, ch.message)
        if req.stream:
            return StreamingResponse(
                dialects.responses_sse(req, completion, rid, gateway.model_name, decode),
                media_type="text/event-stream",
            )
        output = dialects.response_output(ch, decode)
        status = "incomplete" if ch.finish_reason == "length" else "completed"
        return dialects.response_json(req, completion, rid, gateway.model_name, output, status)


def _add_anthropic_routes(app: Any, gateway: Gateway) -> None:
    """Anthropic's Messages API, plain or streamed, its errors in Anthropic's shape."""

    @app.post("/s/{token}/v1/messages")
    async def messages(token: str, request: Request) -> Any:
        try:
            session = gateway._lookup(token)
            req = dialects.parse_messages(await _read_body(request), session.rollout.max_tokens_per_turn)
            if not gateway.serves(req.chat.model):
                raise _no_model(req.chat.model, gateway.model_name)
            completion = await session.complete(req.chat, req.tools)
        except GatewayError as exc:
            if exc.status >= 500:
                log.warning("gateway request failed: %s (%r)", exc.message, exc.__cause__)
            return JSONResponse(dialects.anthropic_error(exc), status_code=exc.status)
        if req.stream:
            return StreamingResponse(
                dialects.messages_sse(req, completion, gateway.model_name), media_type="text/event-stream"
            )
        return dialects.message_json(req, completion, gateway.model_name)


def _no_model(name: str, served: str) -> GatewayError:
    # OpenAI's words first (clients match on them), then what this server does serve and how to ask for it.
    return GatewayError(
        404,
        f"The model `{name[:200]}` does not exist or you do not have access to it. This agentrl gateway serves "
        f"`{served}`: ask for that (a harness agent: `task.model`; a command: $AGENTRL_MODEL), or serve "
        f"your name as an alias of it (`agentrl gateway --alias {name[:200]}`).",
        param="model",
        code="model_not_found",
    )


async def _read_body(request: Any) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise GatewayError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise GatewayError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def _usage(c: Completion) -> dict[str, int]:
    completion_tokens = sum(len(ch.sample.sampled_ids) for ch in c.choices)
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": c.prompt_tokens + completion_tokens,
    }


def _token_logprobs(ids: list[int], logprobs: list[float], decode: Callable[[list[int]], str]) -> list[dict]:
    out = []
    for tok, lp in zip(ids, logprobs, strict=False):
        text = decode([tok])
        out.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode("utf-8", "surrogatepass")),
                "top_logprobs": [],
            }
        )
    return out


def _completion_json(
    c: Completion, model: str, logprobs: bool, decode: Callable[[list[int]], str]
) -> dict[str, Any]:
    choices = []
    for i, ch in enumerate(c.choices):
        lp = (
            {"content": _token_logprobs(ch.content_ids, ch.sample.logprobs, decode), "refusal": None}
            if logprobs
            else None
        )
        choices.append({"index": i, "message": ch.message, "logprobs": lp, "finish_reason": ch.finish_reason})
    return {
        "id": c.id,
        "object": "chat.completion",
        "created": c.created,
        "model": model,
        "system_fingerprint": f"agentrl-v{c.policy_version}",
        "choices": choices,
        "usage": _usage(c),
    }


async def _sse(
    c: Completion, model: str, logprobs: bool, include_usage: bool, decode: Callable[[list[int]], str]
) -> AsyncIterator[bytes]:
    base = {
        "id": c.id,
        "object": "chat.completion.chunk",
        "created": c.created,
        "model": model,
        "system_fingerprint": f"agentrl-v{c.policy_version}",
    }

    def chunk(choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> bytes:
        body = {**base, "choices": [choice] if choice is not None else []}
        if include_usage:
            body["usage"] = usage
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    for i, ch in enumerate(c.choices):
        yield chunk(
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )
        calls = ch.message.get("tool_calls")
        if calls:
            # The calls' tokens are the text's tokens: their log-probs come with the first chunk, as
            # many as the unstreamed reply's.
            lp = (
                {"content": _token_logprobs(ch.content_ids, ch.sample.logprobs, decode)} if logprobs else None
            )
            if ch.message.get("content"):
                yield chunk(
                    {
                        "index": i,
                        "delta": {"content": ch.message["content"]},
                        "logprobs": lp,
                        "finish_reason": None,
                    }
                )
                lp = None
            for k, call in enumerate(calls):
                yield chunk(
                    {
                        "index": i,
                        "delta": {"tool_calls": [{"index": k, **call}]},
                        "logprobs": lp,
                        "finish_reason": None,
                    }
                )
                lp = None
        else:
            offset = 0
            for text, ids in text_pieces(ch, decode):
                lp = None
                if logprobs:
                    lp = {
                        "content": _token_logprobs(
                            ids, ch.sample.logprobs[offset : offset + len(ids)], decode
                        )
                    }
                offset += len(ids)
                yield chunk({"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": None})
        yield chunk({"index": i, "delta": {}, "logprobs": None, "finish_reason": ch.finish_reason})
    if include_usage:
        yield chunk(None, _usage(c))
    yield b"data: [DONE]\n\n"


# --- the rollout's gateway ------------------------------------------------------------------------------

_shared: dict[tuple[int, int, str | None], Gateway] = {}
_shared_lock = threading.Lock()


def shared_gateway(policy: Any, masker: ChatMasker) -> Gateway:
    """The gateway a rollout's harness episodes use for `policy`, rendering as `masker` does: started on
    first use, kept while the policy lives (stopped when it is garbage-collected or at exit)."""
    key = (id(policy), id(masker.tokenizer), masker.chat_template)
    with _shared_lock:
        gw = _shared.get(key)
        if gw is not None and gw._thread is not None and gw._thread.is_alive():
            return gw
        gw = Gateway(
            policy,
            tokenizer=masker.tokenizer,
            chat_template=masker.chat_template,
            template_kwargs=masker.template_kwargs,
        ).start()
        _shared[key] = gw
    with contextlib.suppress(TypeError):  # a policy that takes no weak references lives as long as we do
        weakref.finalize(policy, _drop_shared, key)
    return gw


def _drop_shared(key: tuple[int, int, str | None]) -> None:
    with _shared_lock:
        gw = _shared.pop(key, None)
    if gw is not None:
        gw.stop()
