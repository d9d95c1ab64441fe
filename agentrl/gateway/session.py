"""One episode's session: every chat completion it serves, captured token-exact, stitched into trajectories.

Token ids are the truth, as in the native rollout (`agentrl.rollout.masker`). Each sampled choice is a
`Sample`: the ids the gateway fed the engine before it (the prompt, or the observation delta since its
parent), the ids the engine sampled, their log-probs and the policy versions. The samples of a session
form a tree:

- A request *extends* a sample when its messages are that sample's request messages followed by the
  assistant reply the gateway returned for it (same text, same calls: `protocol.reply_key`). The engine
  is then given the sample's own context, its sampled ids exactly as sampled (never re-rendered nor
  re-tokenized), and the new messages rendered once as a template delta (`ChatMasker.observation_ids`,
  mask 0): what the native loop feeds the engine for the same conversation, id for id.
- Any other request (the first one; a harness that dropped reasoning, edited, truncated or
  re-ordered history, changed the tools) starts a new root: the whole conversation rendered by the
  chat template. After the first call that is *drift*: the call is counted (`drifted_calls`) and its
  branch is a trajectory of its own, so nothing is trained on tokens the policy did not sample.

Every leaf of the tree is one `Trajectory` (`branches()`): branch 0 ends at the session's last call,
the others follow in the order their leaves were sampled. They share the episode's reward and group.

Sampling follows the rollout: the rollout's temperature and top-p (a request's own values are
counted and ignored, because the trainer computes its log-probs at the rollout's temperature), its
`max_tokens_per_turn` and `max_total_tokens`, and the native loop's per-turn seeds
(`agentrl.rollout.config.turn_seed`). A session opened with `lock_sampling=False` (the `agentrl
gateway` server: nothing trains on it) honours the request's temperature, top-p and seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from agentrl.env.parsers import ToolCallParser
from agentrl.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    GatewayError,
    NamedToolChoice,
    message_key,
    normal_message,
    reply_key,
    session_not_found,
)
from agentrl.rollout.cluster import episode_group
from agentrl.rollout.config import RolloutConfig, turn_seed
from agentrl.rollout.masker import ChatMasker, MaskedSequence
from agentrl.rollout.policy import Generation, SamplingConfig, StopReason

if TYPE_CHECKING:
    from agentrl.core.types import FinishReason, Message

log = logging.getLogger(__name__)

ToolsPrompt = Literal["system", "template"]
"""How a request's tools reach the model: written into the system message by the session's tool-call
format (`ToolCallFormat.system_block`, what a native environment shows with `tools_in_prompt`), or passed
to the chat template's `tools`."""

# Gateway metrics, process-wide (as the masker's DRIFT_METRICS): sessions opened, calls served, calls
# that did not extend their session (drift), branches they started, requests whose sampling arguments
# were overridden by the rollout's.
GATEWAY_METRICS: Counter[str] = Counter()
_metrics_lock = threading.Lock()

# A seed offset per extra choice of an `n > 1` request: choice 0 samples with the native loop's seed.
_CHOICE_SEED_STRIDE = 0x9E3779B97F4A7C15
_SEED_RANGE = 2**63
# Responses a session keeps for `previous_response_id` (the Responses API): its most recent ones.
_KEPT_RESPONSES = 64


def count_metrics(**deltas: int) -> None:
    """Add to the process-wide gateway metrics (`GATEWAY_METRICS["gateway/<name>"]`)."""
    with _metrics_lock:
        for key, value in deltas.items():
            GATEWAY_METRICS[f"gateway/{key}"] += value


def _chain_hash(previous: str, part: str) -> str:
    return hashlib.blake2b(
        (previous + "\x00" + part).encode("utf-8", "surrogatepass"), digest_size=16
    ).hexdigest()


@dataclass(eq=False)
class Sample:
    """One sampled choice of one call, and where it sits in the session's tree."""

    call: int
    """Index of the call in the session (0 for the first request)."""
    choice: int
    parent: Sample | None
    """The sample this one's context extends; None for a root (a first call, or drift)."""
    forced_ids: list[int]
    """Ids fed to the engine that it did not sample: the whole prompt for a root, else the parent's
    turn close, the new messages and the generation prompt (mask 0)."""
    forced_messages: list[Message]
    """The messages `forced_ids` render (template form)."""
    notes: list[str]
    """Template problems met rendering `forced_ids` (a delta that was not append-only)."""
    sampled_ids: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    policy_version: int
    policy_version_end: int
    token_versions: list[int]
    """The weights version of each of `sampled_ids` (`Generation.versions()`)."""
    action_text: str
    """What the policy wrote, as the environment reads it (the sampled text, end-of-turn token excluded)."""
    reply: dict[str, Any]
    """The assistant message the gateway returned, in normal form (what a harness sends back)."""
    drifted: bool
    """Whether this sample's root was a drifted call (it did not extend the session's history)."""
    masker: ChatMasker
    """The renderer of its conversation (the chat template with the request's tools)."""
    continued: bool = False
    """Whether a later call extends this sample (then it is not a leaf)."""
    tools: list[dict[str, Any]] | None = None
    """The tools its request declared (OpenAI tool schemas), however they were shown to the model."""


@dataclass
class Branch:
    """One leaf's chain of samples, assembled as the native loop assembles an episode."""

    seq: MaskedSequence
    versions: list[int]
    drifted: bool
    samples: list[Sample]
    masker: ChatMasker


@dataclass
class _Plan:
    """A request, ready for the engine."""

    call: int
    parent: Sample | None
    seq: MaskedSequence
    forced_ids: list[int]
    forced_messages: list[Message]
    notes: list[str]
    n_messages: int
    """How many messages the request held (its samples' replies come after them)."""
    prefix_hash: str
    """The chained hash of the tools and those messages."""
    masker: ChatMasker
    samplings: list[SamplingConfig]
    stops: list[str]
    parse_tools: bool
    drifted: bool
    tools: list[dict[str, Any]] | None = None


@dataclass
class Choice:
    """One choice of a served completion, as the HTTP layer writes it."""

    message: dict[str, Any]
    """The assistant message: role, content (str or None), tool_calls (OpenAI shape) when any."""
    finish_reason: str
    sample: Sample
    content_ids: list[int]
    """The sampled ids whose text the content and log-probs cover (the end-of-turn token excluded)."""


@dataclass
class Completion:
    choices: list[Choice]
    prompt_tokens: int
    policy_version: int
    id: str = field(default_factory=lambda: f"chatcmpl-{random_hex(32)}")
    created: int = field(default_factory=lambda: int(time.time()))


def text_pieces(ch: Choice, decode: Callable[[list[int]], str]) -> list[tuple[str, list[int]]]:
    """The content as streamed: one piece per sampled token whose text is complete (a token that ends
    inside a UTF-8 character waits for the next), with the ids each piece covers; the pieces add up to
    exactly the content."""
    content = ch.message.get("content") or ""
    pieces: list[tuple[str, list[int]]] = []
    emitted = 0
    start = 0
    for j in range(1, len(ch.content_ids) + 1):
        text = decode(ch.content_ids[:j])[: len(content)]
        if text.endswith("\ufffd") or len(text) <= emitted or not content.startswith(text):
            continue
        pieces.append((text[emitted:], ch.content_ids[start:j]))
        emitted, start = len(text), j
    if emitted < len(content) or start < len(ch.content_ids):
        pieces.append((content[emitted:], ch.content_ids[start:]))
    return [p for p in pieces if p[0] or p[1]]


class Session:
    """One episode's session (see the module docstring); `url` is what its harness talks to.

    Opened by `Gateway.session(...)`; thread-safe: the gateway's server thread serves it while the
    rollout's thread steps the environment and, at the end, `close`s it and reads `branches()`.
    """

    def __init__(
        self,
        gateway: Any,
        token: str,
        *,
        rollout: RolloutConfig,
        seed: int | None,
        index: int,
        max_calls: int | None,
        parser: ToolCallParser,
        lock_sampling: bool,
        group_id: str,
        on_close: Callable[[Session], None] | None,
        policy: Any = None,
        tools_prompt: ToolsPrompt = "system",
    ):
        self.gateway = gateway
        self.policy = policy if policy is not None else gateway.policy
        """What samples this session's completions (the gateway's policy unless the session was given one)."""
        self.token = token
        self.rollout = rollout
        self.seed = seed
        self.index = index
        self.max_calls = max_calls
        self.parser = parser
        self.lock_sampling = lock_sampling
        self.group_id = group_id
        self.tools_prompt = tools_prompt
        self._on_close = on_close
        self._lock = threading.Lock()
        self.samples: list[Sample] = []
        self._by_key: dict[tuple[int, str], Sample] = {}
        self.calls = 0
        """Calls accepted so far (the next call's turn number, for its seed)."""
        self.drifted_calls = 0
        self.sampling_overridden = 0
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.generate_s = 0.0
        self._responses: dict[str, list[dict[str, Any]]] = {}
        self._inflight: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = set()

    @property
    def url(self) -> str:
        """The base URL an OpenAI client takes (`OpenAI(base_url=session.url)`)."""
        return f"{self.gateway.url}/s/{self.token}/v1"

    @property
    def anthropic_url(self) -> str:
        """The base URL an Anthropic client takes (it adds `/v1/messages`)."""
        return f"{self.gateway.url}/s/{self.token}"

    @property
    def closed(self) -> bool:
        return self.finish_reason is not None

    def close(self, reason: FinishReason, error: str | None = None) -> bool:
        """End the session (later calls get 404); the first reason given is kept. True if this call closed it."""
        with self._lock:
            if self.finish_reason is not None:
                return False
            self.finish_reason, self.error = reason, error
            inflight = list(self._inflight)
        for loop, sampling in inflight:
            with contextlib.suppress(RuntimeError):  # the server's loop is already closed
                loop.call_soon_threadsafe(sampling.cancel)
        self.gateway.forget(self.token)
        if self._on_close is not None:
            self._on_close(self)
        return True

    # --- serving ------------------------------------------------------------------------------------

    async def complete(
        self, req: ChatCompletionRequest, raw_tools: list[dict[str, Any]] | None
    ) -> Completion:
        """Serve one request: plan it, sample its `n` choices, record them. `GatewayError` for what the
        caller did wrong or for a session that is over."""
        plan = self._plan(req, raw_tools)
        t0 = time.perf_counter()
        prompt = list(plan.seq.token_ids)
        with episode_group(self.group_id):  # a policy of several engines keeps a group on one
            sampling = asyncio.ensure_future(
                asyncio.gather(*(self.policy.generate(prompt, s) for s in plan.samplings))
            )
        loop = asyncio.get_running_loop()
        with self._lock:
            self._inflight.add((loop, sampling))
        try:
            # Closing the session cancels `sampling` (the engine aborts the requests): nobody would read them.
            await asyncio.wait({sampling})
        finally:
            with self._lock:
                self._inflight.discard((loop, sampling))
            sampling.cancel()
        exc = None if sampling.cancelled() else sampling.exception()  # retrieved: never logged as lost
        if sampling.cancelled() or self.closed:
            # Closed meanwhile (the episode timed out or ended): the engine's requests were aborted for
            # that reason, not because it failed (a gather cancelled that way reports a CancelledError).
            raise session_not_found()
        if exc is not None and plan.samplings[0].structural_tag is not None and isinstance(exc, ValueError):
            # The engine refused the constraint when it was added (nothing was sampled): the request's fault.
            raise GatewayError(
                400,
                f"The tool_choice constraint was refused by the engine: {str(exc)[:300]}",
                param="tool_choice",
            ) from exc
        if exc is not None:
            # As in the native loop: the engine's failure ends the episode (with its own reason, if it names one).
            self.close(getattr(exc, "finish_reason", "env_error"), f"{type(exc).__name__}: {exc}")
            raise GatewayError(
                500,
                f"The policy engine failed on this request ({type(exc).__name__}); the episode is over.",
                type="server_error",
            ) from exc
        gens: list[Generation] = list(sampling.result())
        self.generate_s += time.perf_counter() - t0
        return self._record(plan, gens)

    def _plan(self, req: ChatCompletionRequest, raw_tools: list[dict[str, Any]] | None) -> _Plan:
        """The request ready for the engine: its call number, the context it extends (or a new root), the
        ids to feed, and each choice's sampling. `GatewayError` for what cannot be served."""
        asked = self._asked_tokens(req)
        messages = [normal_message(m) for m in req.messages]
        in_system = self.tools_prompt == "system" and bool(raw_tools)
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        structure = self._structure(req, raw_tools) if parse_tools else None
        try:
            masker = self.gateway.masker_for(None if in_system else raw_tools)
        except Exception as exc:  # tools the chat template cannot render
            raise _unrenderable(exc, "tools") from None
        tools_key = json.dumps(raw_tools, sort_keys=True) if raw_tools else ""
        call, parent, prefix, hashes = self._take_call(messages, tools_key)
        if parent is not None:
            seq, forced_ids, forced_messages, notes = self._extend(parent, messages[prefix:], masker)
            drifted = parent.drifted
        else:
            seq, forced_messages = self._root(messages, masker, raw_tools if in_system else None)
            forced_ids, notes = list(seq.token_ids), []
            drifted = call > 0
            if drifted:
                with self._lock:
                    self.drifted_calls += 1
                count_metrics(drifted_calls=1, branches=1)
        max_tokens = min(self.rollout.max_tokens_per_turn, self._budget(seq), *([asked] if asked else []))
        samplings = [self._sampling(req, call, i, max_tokens, masker, structure) for i in range(req.n)]
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        count_metrics(calls=1)
        return _Plan(
            call,
            parent,
            seq,
            forced_ids,
            forced_messages,
            notes,
            len(messages),
            hashes[-1],
            masker,
            samplings,
            stops,
            parse_tools,
            drifted,
            raw_tools,
        )

    def _asked_tokens(self, req: ChatCompletionRequest) -> int | None:
        """The request's own completion budget (`max_completion_tokens`, else `max_tokens`), refused above
        the rollout's `max_tokens_per_turn`."""
        limit = self.rollout.max_tokens_per_turn
        asked = req.max_completion_tokens or req.max_tokens
        if asked and asked > limit:
            name = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
            raise GatewayError(
                400,
                f"'{name}' is {asked}, above this session's limit of {limit} tokens per "
                f"completion (the rollout's max_tokens_per_turn); ask for at most {limit}, or "
                "leave it unset.",
                param=name,
            )
        return asked

    def _take_call(
        self, messages: list[Message], tools_key: str
    ) -> tuple[int, Sample | None, int, list[str]]:
        """Number the call and find the sample it extends: (call, parent or None, how many of the messages
        the parent's context holds, the chained hashes). A session that is over, or a call past the
        session's `max_calls` (which ends it `max_turns`), answers 404."""
        with self._lock:
            if self.finish_reason is not None:
                raise session_not_found()
            call_limit = self.max_calls is not None and self.calls >= self.max_calls
            call = self.calls
            if not call_limit:
                self.calls += 1
            parent, prefix, hashes = self._find_parent(messages, tools_key)
        if call_limit:
            self.close("max_turns", f"the harness asked for more than {self.max_calls} completions")
            raise session_not_found()
        return call, parent, prefix, hashes

    def _extend(
        self, parent: Sample, new_messages: list[Message], masker: ChatMasker
    ) -> tuple[MaskedSequence, list[int], list[Message], list[str]]:
        """The parent's context with the new messages appended as a template delta (mask 0): (the sequence,
        the ids forced, the messages they render, the template's notes on them)."""
        seq = self._sequence(parent)
        new = [dict(m) for m in new_messages]
        notes_before = len(seq.notes)
        try:
            ids = masker.observation_ids(seq, new)
        except Exception as exc:  # new messages the chat template cannot render
            raise _unrenderable(exc, "messages") from None
        notes = seq.notes[notes_before:]
        masker.add_observation(seq, new, ids)
        return seq, ids, new, notes

    def _root(
        self, messages: list[Message], masker: ChatMasker, system_tools: list[dict[str, Any]] | None
    ) -> tuple[MaskedSequence, list[Message]]:
        """A new root: the whole conversation rendered by the chat template, with `system_tools` (when the
        session shows the tools there) written into its system message by the session's tool-call format;
        (the sequence, the messages rendered)."""
        template = [dict(m) for m in messages]
        if system_tools:
            template = tools_in_system(template, self.parser.system_block(system_tools))
        try:
            return masker.start(template), template
        except Exception as exc:  # a conversation the chat template cannot render
            raise _unrenderable(exc, "messages") from None

    def _budget(self, seq: MaskedSequence) -> int:
        """The tokens left in the context budget after `seq`; none left ends the session `max_tokens`."""
        cfg = self.rollout
        budget = cfg.max_total_tokens - len(seq)
        if budget <= 0:
            reason = (
                f"the conversation is {len(seq)} tokens; the context budget is {cfg.max_total_tokens} tokens"
            )
            self.close("max_tokens", reason)
            raise GatewayError(
                400,
                f"This model's maximum context length is exceeded: {reason}.",
                param="messages",
                code="context_length_exceeded",
            )
        return budget

    def _structure(self, req: ChatCompletionRequest, raw_tools: list[dict[str, Any]] | None) -> str | None:
        """The constraint that honours the request's `tool_choice` and `parallel_tool_calls` at sampling time
        (None: sampled freely), or a `GatewayError` where it cannot be honoured."""
        named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
        required = req.tool_choice == "required" or named is not None
        single = named is not None or req.parallel_tool_calls is False
        if not required and not single:
            return None
        what = (
            f"tool_choice {req.tool_choice!r}"
            if required and named is None
            else f"tool_choice naming {named!r}"
            if named is not None
            else "parallel_tool_calls false"
        )
        if not getattr(self.policy, "supports_constraints", False):
            raise GatewayError(
                400,
                f"{what} cannot be honoured by this engine ({type(self.policy).__name__} samples without "
                "constraints); leave tool_choice 'auto' (and parallel_tool_calls unset), or serve with vLLM.",
                param="tool_choice",
            )
        return tool_call_structure(
            self.parser,
            raw_tools or [],
            [named] if named else None,
            required=required,
            single=single,
            what=what,
        )

    def _sampling(
        self,
        req: ChatCompletionRequest,
        call: int,
        choice: int,
        max_tokens: int,
        masker: ChatMasker,
        structure: str | None = None,
    ) -> SamplingConfig:
        cfg = self.rollout
        temperature, top_p = cfg.temperature, cfg.top_p
        seed = None if self.seed is None else turn_seed(self.seed, self.index, call)
        if self.lock_sampling:
            asked = (req.temperature, req.top_p, req.seed)
            if choice == 0 and any(
                a is not None and a != v for a, v in zip(asked, (temperature, top_p, seed), strict=True)
            ):
                self.sampling_overridden += 1
                count_metrics(sampling_overridden=1)
        else:
            temperature = cfg.temperature if req.temperature is None else req.temperature
            top_p = cfg.top_p if req.top_p is None else req.top_p
            seed = req.seed if req.seed is not None else seed
        if seed is not None and choice:
            seed = (seed + choice * _CHOICE_SEED_STRIDE) % _SEED_RANGE
        return SamplingConfig(
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=seed,
            stop_token_ids=masker.stop_token_ids,
            structural_tag=structure,
            # Once the constrained calls are written, the turn ends with the template's end-of-turn token
            # (the grammar would otherwise also allow the model's EOS, which the template never writes).
            ignore_eos=structure is not None,
        )

    def _record(self, plan: _Plan, gens: list[Generation]) -> Completion:
        masker = plan.masker
        choices: list[Choice] = []
        samples: list[Sample] = []
        for i, gen in enumerate(gens):
            ids, logprobs, reason = list(gen.token_ids), list(gen.logprobs), gen.stop_reason
            content_cut: int | None = None
            if plan.stops:
                ids, logprobs, reason, content_cut = _cut_at_stop(masker, ids, logprobs, reason, plan.stops)
            action = masker.action_text(ids, reason)
            content_ids = ids[:-1] if reason == "stop" and ids and ids[-1] == masker.end_of_turn_id else ids
            message, finish = self._reply(
                action if content_cut is None else action[:content_cut], plan, reason
            )
            sample = Sample(
                call=plan.call,
                choice=i,
                parent=plan.parent,
                forced_ids=plan.forced_ids,
                forced_messages=plan.forced_messages,
                notes=plan.notes,
                sampled_ids=ids,
                logprobs=logprobs,
                stop_reason=reason,
                policy_version=gen.policy_version,
                policy_version_end=gen.policy_version_end,
                token_versions=gen.versions()[: len(ids)],  # a stop string may have cut the ids
                action_text=action,
                reply=_normal_reply(message),
                drifted=plan.drifted,
                masker=masker,
                tools=plan.tools,
            )
            samples.append(sample)
            choices.append(Choice(message, finish, sample, content_ids))
        over_budget = any(
            s.stop_reason == "length" and len(plan.seq) + len(s.sampled_ids) >= self.rollout.max_total_tokens
            for s in samples
        )
        with self._lock:
            if self.finish_reason is not None:  # closed while the engine sampled: nobody will read it
                raise session_not_found()
            if plan.parent is not None:
                plan.parent.continued = True
            for s in samples:
                self.samples.append(s)
                self._by_key[
                    (plan.n_messages + 1, _chain_hash(plan.prefix_hash, "R" + reply_key(s.reply)))
                ] = s
        if over_budget:
            # As the native loop: a turn cut by the context budget is returned but ends the episode.
            self.close(
                "max_tokens",
                f"call {plan.call + 1} ran into the context budget of {self.rollout.max_total_tokens} tokens",
            )
        return Completion(choices, len(plan.seq), min(g.policy_version for g in gens))

    def _reply(self, text: str, plan: _Plan, reason: StopReason) -> tuple[dict[str, Any], str]:
        """The assistant message for `text` and its finish reason: tool calls parsed when the request
        offered tools (a message with a malformed call comes back as text, whole)."""
        finish = "length" if reason == "length" else "stop"
        if plan.parse_tools:
            try:
                parsed = self.parser.parse(text)
            except Exception as exc:  # a plugin parser that raises: the text goes back as it is
                log.warning("tool-call parser %r raised on a model message: %r", self.parser.name, exc)
                parsed = None
            # A call to a function the request did not declare is not a tool call: OpenAI's API never
            # returns one; the text comes back whole (and the environment refuses to run it).
            declared = {(t.get("function") or {}).get("name") or t.get("name") for t in plan.tools or ()}
            if (
                parsed is not None
                and parsed.calls
                and not parsed.errors
                and all(c.name in declared for c in parsed.calls)
            ):
                # Fresh ids, as OpenAI's: frameworks key tool results (and repeats) on them.
                calls = [
                    {
                        "id": new_call_id(),
                        "type": "function",
                        "function": {
                            "name": c.name,
                            "arguments": json.dumps(c.arguments, ensure_ascii=False),
                        },
                    }
                    for c in parsed.calls
                ]
                return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, (
                    "tool_calls" if reason == "stop" else finish
                )
        return {"role": "assistant", "content": text}, finish

    # --- the Responses API's stored responses ------------------------------------------------------------

    def remember_response(self, rid: str, messages: list[dict[str, Any]], reply: dict[str, Any]) -> None:
        """Keep a response's conversation for a later `previous_response_id` (the most recent ones)."""
        with self._lock:
            self._responses[rid] = [*messages, dict(reply)]
            while len(self._responses) > _KEPT_RESPONSES:
                self._responses.pop(next(iter(self._responses)))

    def response_history(self, rid: str) -> list[dict[str, Any]]:
        """The conversation `previous_response_id=rid` continues (a 404 for a response this session did not give)."""
        with self._lock:
            history = self._responses.get(rid)
        if history is None:
            raise GatewayError(
                404,
                f"Previous response with id '{rid[:80]}' not found: a session continues its own responses only "
                f"(its last {_KEPT_RESPONSES}).",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return [dict(m) for m in history]

    # --- the tree ------------------------------------------------------------------------------------

    def _find_parent(
        self, messages: list[dict[str, Any]], tools_key: str
    ) -> tuple[Sample | None, int, list[str]]:
        """The deepest sample whose request messages plus reply begin `messages` (caller holds the lock),
        how many messages that covers, and the chained hashes of the tools and each prefix of `messages`."""
        hashes = [_chain_hash("", tools_key)]
        for m in messages:
            hashes.append(_chain_hash(hashes[-1], message_key(m)))
        for k in range(len(messages), 0, -1):
            m = messages[k - 1]
            if m["role"] != "assistant":
                continue
            hit = self._by_key.get((k, _chain_hash(hashes[k - 1], "R" + reply_key(m))))
            if hit is not None:
                return hit, k, hashes
        return None, 0, hashes

    def _sequence(self, leaf: Sample) -> MaskedSequence:
        """The masked sequence of the chain that ends with `leaf`'s sampled ids."""
        chain = []
        node: Sample | None = leaf
        while node is not None:
            chain.append(node)
            node = node.parent
        chain.reverse()
        root = chain[0]
        seq = MaskedSequence(
            token_ids=list(root.forced_ids),
            loss_mask=[0] * len(root.forced_ids),
            behavior_logprobs=[0.0] * len(root.forced_ids),
            prompt_len=len(root.forced_ids),
            messages=[dict(m) for m in root.forced_messages],
        )
        for i, s in enumerate(chain):
            if i:
                seq.append_forced(s.forced_ids)
                seq.messages.extend(dict(m) for m in s.forced_messages)
                seq.ends_in_generation_prompt = True
            seq.notes.extend(s.notes)
            seq.append_sampled(s.sampled_ids, s.logprobs, s.stop_reason, s.token_versions)
            seq.messages.append({"role": "assistant", "content": s.action_text})
        return seq

    def branches(self) -> list[Branch]:
        """Every leaf's chain (see the module docstring): branch 0 ends at the last call."""
        with self._lock:
            leaves = [s for s in self.samples if not s.continued]
        if not leaves:
            return []
        last = max(leaves, key=lambda s: (s.call, -s.choice))
        ordered = [last, *(s for s in leaves if s is not last)]
        out = []
        for leaf in ordered:
            seq = self._sequence(leaf)
            chain, node = [], leaf
            while node is not None:
                chain.append(node)
                node = node.parent
            chain.reverse()
            versions = [v for s in chain for v in (s.policy_version, s.policy_version_end)]
            out.append(Branch(seq, versions, leaf.drifted, chain, leaf.masker))
        return out

    def declared_tools(self) -> list[list[dict[str, Any]] | None]:
        """The tools each sampled call's request declared, in call order (None: a request without tools)."""
        with self._lock:
            return [s.tools for s in self.samples]

    def sample_for(self, message: dict[str, Any]) -> Sample | None:
        """The most recent sample whose reply is `message` (an assistant message in normal form)."""
        key = reply_key(message)
        with self._lock:
            for s in reversed(self.samples):
                if reply_key(s.reply) == key:
                    return s
        return None


def tool_call_structure(
    parser: ToolCallParser,
    tools: list[dict[str, Any]],
    names: list[str] | None,
    *,
    required: bool,
    single: bool,
    what: str = "tool_choice",
) -> str:
    """The structure (xgrammar's structural tag, JSON) of a reply whose calls are written in `parser`'s
    format to the functions in `tools` (those named in `names`), each call's arguments following its
    function's JSON schema. `required`: the reply is one or more calls and nothing else (one when
    `single`); else free text with at most one call, then the end of the turn. The format's own
    wording comes from its `render_calls`, so the constrained text is what the model writes unconstrained."""
    key = json.dumps([parser.name, tools, names, required, single], sort_keys=True)
    return _structure_cached(key, parser, what)


@functools.lru_cache(maxsize=256)
def _structure_cached(key: str, parser: ToolCallParser, what: str) -> str:
    _name, tools, names, required, single = json.loads(key)
    try:
        one = parser.render_calls([("f", {})])
        two = parser.render_calls([("f", {}), ("f", {})])
    except NotImplementedError:
        raise GatewayError(
            400,
            f"{what} cannot be honoured: the tool-call format {parser.name!r} cannot write calls.",
            param="tool_choice",
        ) from None
    separator = two[len(one) : len(two) - len(one)]
    tags = []
    for tool in tools:
        function = tool.get("function") or {}
        name = function.get("name")
        if names is not None and name not in names:
            continue
        text = parser.render_calls([(name, {})])
        cut = text.rfind("{}")
        schema = function.get("parameters") or {"type": "object"}
        tags.append(
            {
                "type": "tag",
                "begin": text[:cut],
                "content": {"type": "json_schema", "json_schema": schema},
                "end": text[cut + 2 :],
            }
        )
    if required:
        fmt: dict[str, Any] = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": single,
        }
    else:
        begins = [t["begin"] for t in tags]
        trigger = begins[0]
        while any(not b.startswith(trigger) for b in begins):  # the prefix every call begins with
            trigger = trigger[:-1]
        trigger = trigger or begins[0]
        fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": True}
    structure = json.dumps({"type": "structural_tag", "format": fmt})
    try:
        import xgrammar
    except ImportError:  # the engine validates it
        return structure
    try:
        xgrammar.Grammar.from_structural_tag(structure)
    except Exception as exc:
        raise GatewayError(
            400,
            f"{what} cannot be honoured for these tools: their schemas do not compile to a constraint "
            f"({type(exc).__name__}: {str(exc)[:300]}).",
            param="tools",
        ) from None
    return structure


def tools_in_system(messages: list[dict[str, Any]], block: str) -> list[dict[str, Any]]:
    """`messages` with the tools' block written into the system message, as an environment writes it
    (`ToolEnv.system_prompt`: its instructions, a blank line, the block); a system message of its own when
    the conversation has none."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


# Ids of completions, calls and responses: unique, not secret (the session token is the credential). Drawn
# from one generator seeded once by the OS: a system call per id costs a loaded box milliseconds.
_ids = random.Random(secrets.randbits(128))
_ids_lock = threading.Lock()


def random_hex(digits: int) -> str:
    with _ids_lock:
        return f"{_ids.getrandbits(4 * digits):0{digits}x}"


def new_call_id() -> str:
    """A tool call's id as OpenAI writes them: unique per call (96 random bits)."""
    return f"call_{random_hex(24)}"


def _unrenderable(exc: Exception, what: str) -> GatewayError:
    return GatewayError(
        400,
        f"The model's chat template cannot render these {what}: {type(exc).__name__}: {str(exc)[:300]}",
        param=what,
    )


def _normal_reply(message: dict[str, Any]) -> dict[str, Any]:
    """The reply in the normal form a harness's copy of it takes (`protocol.normal_message`)."""
    return normal_message(ChatMessage.model_validate(message))


def _cut_at_stop(
    masker: ChatMasker, ids: list[int], logprobs: list[float], reason: StopReason, stops: list[str]
) -> tuple[list[int], list[float], StopReason, int | None]:
    """OpenAI's `stop` strings on a finished sample: keep the sampled ids up to the one that completes the
    first stop string (they were sampled; the ones after it are dropped, never seen by the policy again),
    and where the returned text ends (the stop string is not part of it, as OpenAI returns it)."""
    text = masker.decode(ids)
    if not any(s in text for s in stops):
        return ids, logprobs, reason, None
    lo, hi = 1, len(ids)  # the fewest ids whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in masker.decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    kept = masker.decode(ids[:lo])
    cut = min(kept.index(s) for s in stops if s in kept)
    return ids[:lo], logprobs[:lo], "stop", cut
