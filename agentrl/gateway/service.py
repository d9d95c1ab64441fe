"""An agent as a service: the trainer hands out episodes to an agent process it does not start.

Your agent runs as a program of its own (a service you deploy, a scaffold with its own process model,
another language). The rollout offers each episode at a fixed address; the agent takes it, plays it
against the episode's gateway session (an OpenAI-compatible base URL), has the environment run its tool
calls through the episode's step endpoint, and says when it is done. The environment's verifier scores
the episode, as for any harness episode; nothing the agent sends sets the reward.

    agentrl.register("mylab/Units-svc-v0", "agentrl.gateway:HarnessEnv",
                     env="mylab/Units-v0", service="127.0.0.1:8765")

    # the agent's process (started by you, before or after `agentrl train`):
    from agentrl.gateway.service import EpisodeClient
    for episode in EpisodeClient("http://127.0.0.1:8765").episodes():
        client = openai.OpenAI(base_url=episode.base_url, api_key="unused")
        reply = client.chat.completions.create(model=episode.model, messages=episode.messages, tools=episode.tools)
        observation = episode.step(reply.choices[0].message)   # tool results as OpenAI messages
        episode.end()                                          # or episode.end(error="what went wrong")

The HTTP API (JSON; what `EpisodeClient` speaks):

- `POST /v1/episodes/next` (header `Authorization: Bearer <service token>`; `?wait=S`, at most 60):
  the next episode, or 204 when none was offered within `wait` seconds. An episode is
  `{"episode", "task": {"id", "prompt", "metadata"}, "messages", "tools", "model", "base_url",
  "step_url", "end_url"}`;
- `POST <step_url>` `{"message": <assistant message>}`: runs its tool calls in the environment,
  `{"messages": [...], "done": bool}` (a reply the gateway gave is stepped as the text it sampled);
- `POST <end_url>` `{"error": null | "..."}`: the agent is done (`submitted`), or failed (`agent_error`
  with its text). The reply is `{"finish_reason": ...}`; the reward is never sent back.

The episode URLs carry a 192-bit token of their own, as session URLs do; `next` needs the service token:
`AGENTRL_SERVICE_TOKEN` when set in the trainer's environment (set the same in the agent's), else one
generated and written, readable by you only, to `service_file(address)`, where `EpisodeClient` finds it.
The service and the sessions listen on this machine's loopback: the agent runs on the same machine.

An episode no agent takes within `pickup_timeout_s` ends `agent_error` saying so; the rollout's
`episode_timeout_s` bounds the whole episode as for any harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

HarnessTask = Any  # `agentrl.gateway.harness.HarnessTask` (which imports this module: no import back)

log = logging.getLogger(__name__)

TOKEN_ENV = "AGENTRL_SERVICE_TOKEN"
_MAX_WAIT_S = 60.0


def parse_address(address: str) -> tuple[str, int]:
    """`"host:port"` (or `"http://host:port"`) -> (host, port)."""
    text = address.removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"service address {address!r} must look like 'host:port', e.g. '127.0.0.1:8765'")
    return host.strip("[]"), int(port)


def service_file(address: str) -> Path:
    """Where the service writes its token when `AGENTRL_SERVICE_TOKEN` is not set (readable by you only)."""
    host, port = parse_address(address)
    return Path(tempfile.gettempdir()) / f"agentrl-service-{os.getuid()}-{host}-{port}.json"


class AgentReportedError(RuntimeError):
    """The agent process ended its episode with an error (`POST end {"error": ...}`)."""


@dataclass(eq=False)
class _Offer:
    """One episode offered to the agent processes, from the rollout's side."""

    token: str
    task: HarnessTask
    loop: asyncio.AbstractEventLoop
    ended: asyncio.Future[str | None]
    taken: bool = False
    created: float = field(default_factory=time.monotonic)

    def describe(self, base: str) -> dict[str, Any]:
        t = self.task
        return {
            "episode": self.token,
            "task": {"id": t.task.id, "prompt": t.task.prompt, "metadata": dict(t.task.metadata)},
            "messages": t.messages,
            "tools": t.tools,
            "model": t.model,
            "base_url": t.url,
            "step_url": f"{base}/v1/episodes/{self.token}/step",
            "end_url": f"{base}/v1/episodes/{self.token}/end",
        }

    def end(self, error: str | None) -> None:
        def settle() -> None:
            if not self.ended.done():
                self.ended.set_result(error)

        with contextlib.suppress(RuntimeError):  # the rollout's loop is gone
            self.loop.call_soon_threadsafe(settle)


class EpisodeService:
    """The HTTP server that hands out episodes (see the module docstring); one per address and process,
    started on first use by `episode_service(address)`."""

    def __init__(self, address: str, token: str | None = None):
        self.host, self.port = parse_address(address)
        self.address = f"{self.host}:{self.port}"
        self.url = f"http://{self.address}"
        self.token = token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
        self._offers: dict[str, _Offer] = {}
        self._waiting: list[_Offer] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self.app = self._build_app()

    # --- the rollout's side -------------------------------------------------------------------------

    def offer(self, task: HarnessTask) -> _Offer:
        """Put one episode up for an agent to take; await its `ended` (the agent's error, or None)."""
        loop = asyncio.get_running_loop()
        offer = _Offer(secrets.token_urlsafe(24), task, loop, loop.create_future())
        with self._cond:
            self._offers[offer.token] = offer
            self._waiting.append(offer)
            self._cond.notify_all()
        return offer

    def withdraw(self, offer: _Offer) -> None:
        """The episode is over (whoever ended it): its URLs answer 404 from now on."""
        with self._cond:
            self._offers.pop(offer.token, None)
            with contextlib.suppress(ValueError):
                self._waiting.remove(offer)

    def _take(self, wait_s: float) -> _Offer | None:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while not self._waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            offer = self._waiting.pop(0)
            offer.taken = True
            return offer

    # --- the server ----------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> EpisodeService:
        if self._thread is not None:
            return self
        import socket

        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            from agentrl.core.errors import UserError

            raise UserError(
                f"the agent service cannot listen on {self.address}: {exc.strerror}; is another run serving "
                "there? Give the harness env another service= address"
            ) from None
        sock.listen(256)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve(sockets=[sock])),
            name="agentrl-service",
            daemon=True,
        )
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent service did not start listening on {self.url}")
            time.sleep(0.01)
        self._thread = thread
        if TOKEN_ENV not in os.environ:
            path = service_file(self.address)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"url": self.url, "token": self.token}, f)
            log.warning("agent service at %s; its token is in %s", self.url, path)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = None

    def _build_app(self) -> Any:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        def error(status: int, message: str) -> Any:
            return JSONResponse({"error": {"message": message}}, status_code=status)

        @app.post("/v1/episodes/next")
        async def next_episode(request: Request, wait: float = 30.0) -> Any:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return error(401, f"a wrong or missing service token (Authorization: Bearer ${TOKEN_ENV})")
            wait = min(max(wait, 0.0), _MAX_WAIT_S)
            offer = await asyncio.to_thread(self._take, wait)
            if offer is None:
                return Response(status_code=204)
            return offer.describe(self.url)

        def lookup(token: str) -> _Offer | None:
            with self._cond:
                return self._offers.get(token)

        @app.post("/v1/episodes/{token}/step")
        async def step(token: str, request: Request) -> Any:
            offer = lookup(token)
            if offer is None:
                return error(404, "no such episode: the token is unknown or its episode is over")
            try:
                body = json.loads(await request.body())
                message = body["message"]
            except (ValueError, KeyError, TypeError):
                return error(400, 'the body must be {"message": <an assistant message>}')
            messages = await offer.task.step(message)
            if offer.task.done:
                # The step ended the episode (a submit, a limit): it is over now, not when the rollout's
                # side gets to it, so the agent's `end` that follows finds it over whatever the timing.
                offer.end(None)
                self.withdraw(offer)
            return {"messages": messages, "done": offer.task.done}

        @app.post("/v1/episodes/{token}/end")
        async def end(token: str, request: Request) -> Any:
            offer = lookup(token)
            if offer is None:
                return error(404, "no such episode: the token is unknown or its episode is over")
            raw = await request.body()
            try:
                reported = json.loads(raw).get("error") if raw.strip() else None
            except (ValueError, AttributeError):
                return error(400, 'the body must be {} or {"error": "..."}')
            offer.end(None if reported is None else str(reported)[:4000])
            return {"finish_reason": "submitted" if reported is None else "agent_error"}

        return app


_services: dict[str, EpisodeService] = {}
_services_lock = threading.Lock()


def episode_service(address: str) -> EpisodeService:
    """The process's service at `address`, started on first use."""
    host, port = parse_address(address)
    key = f"{host}:{port}"
    with _services_lock:
        service = _services.get(key)
        if service is None:
            service = _services[key] = EpisodeService(key)
        return service.start()


class ServiceAgent:
    """The harness agent of a `HarnessEnv(service=...)`: offers the episode at the service and waits for
    the agent process that takes it to end it (see the module docstring)."""

    def __init__(self, address: str, pickup_timeout_s: float = 120.0):
        parse_address(address)  # a malformed address fails at registration's make, not mid-rollout
        self.address = address
        self.pickup_timeout_s = pickup_timeout_s

    async def __call__(self, client: Any, task: HarnessTask) -> None:
        service = episode_service(self.address)
        offer = service.offer(task)
        try:
            try:
                error = await asyncio.wait_for(asyncio.shield(offer.ended), self.pickup_timeout_s)
            except TimeoutError:
                if not offer.taken:
                    raise AgentReportedError(
                        f"no agent took this episode from the service at {service.url} within "
                        f"{self.pickup_timeout_s:g}s; start your agent's process (agentrl.gateway.service."
                        "EpisodeClient) pointed at it"
                    ) from None
                error = await offer.ended
        finally:
            service.withdraw(offer)
        if error is not None:
            raise AgentReportedError(f"the agent process reported: {error}")


# --- the agent's side ----------------------------------------------------------------------------------


class ServiceEpisode:
    """One episode taken from the service, in the agent's process."""

    def __init__(self, data: dict[str, Any], http: Any):
        self.data, self._http = data, http
        self.id: str = data["episode"]
        self.task: dict[str, Any] = data["task"]
        self.prompt: str = data["task"]["prompt"]
        self.messages: list[dict[str, Any]] = data["messages"]
        """The environment's first messages (system instructions, the task), as OpenAI messages."""
        self.tools: list[dict[str, Any]] = data["tools"]
        self.model: str = data["model"]
        self.base_url: str = data["base_url"]
        """The episode's OpenAI-compatible base URL (its gateway session)."""
        self.done = False

    def step(self, message: Any) -> list[dict[str, Any]]:
        """Run the tool calls of `message` (an assistant message, or the SDK's object) in the environment;
        the observation as OpenAI messages."""
        if hasattr(message, "model_dump"):
            message = message.model_dump(exclude_none=True)
        r = self._http.post(self.data["step_url"], json={"message": message})
        r.raise_for_status()
        body = r.json()
        self.done = bool(body["done"])
        return body["messages"]

    def end(self, error: str | None = None) -> str:
        """Done (`submitted`: the verifier scores the final state), or failed with `error`; the finish reason."""
        r = self._http.post(self.data["end_url"], json={"error": error})
        if r.status_code == 404:  # the episode had ended already (a limit, the environment)
            return "ended"
        r.raise_for_status()
        return r.json()["finish_reason"]


class EpisodeClient:
    """Takes episodes from a trainer's agent service (see the module docstring).

    url: the service (`http://host:port`); token: the service token (default: `AGENTRL_SERVICE_TOKEN`, else
    the file the service wrote, `service_file`)."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 600.0):
        import httpx

        self.url = "http://" + url.removeprefix("http://").rstrip("/")
        self.token = token or os.environ.get(TOKEN_ENV) or self._token_from_file()
        self._http = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {self.token}"})

    def _token_from_file(self) -> str:
        path = service_file(self.url)
        try:
            return json.loads(path.read_text())["token"]
        except (OSError, ValueError, KeyError):
            raise RuntimeError(
                f"no service token: set {TOKEN_ENV} (the same as the trainer's), or start the trainer first "
                f"(it writes {path})"
            ) from None

    def next(self, wait_s: float = 30.0) -> ServiceEpisode | None:
        """The next episode, or None when none was offered within `wait_s` seconds."""
        import httpx

        try:
            r = self._http.post(f"{self.url}/v1/episodes/next", params={"wait": wait_s}, timeout=wait_s + 30)
        except httpx.TransportError:  # the trainer is not up (yet, or any more)
            time.sleep(min(wait_s, 1.0))
            return None
        if r.status_code == 204:
            return None
        r.raise_for_status()
        return ServiceEpisode(r.json(), self._http)

    def episodes(self, idle_s: float | None = None) -> Iterator[ServiceEpisode]:
        """Episodes as they are offered; stops after `idle_s` seconds without one (None: never)."""
        last = time.monotonic()
        while idle_s is None or time.monotonic() - last < idle_s:
            episode = self.next(wait_s=min(30.0, idle_s) if idle_s is not None else 30.0)
            if episode is not None:
                last = time.monotonic()
                yield episode

    def close(self) -> None:
        self._http.close()
