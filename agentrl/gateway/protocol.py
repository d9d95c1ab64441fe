"""The OpenAI chat-completions wire format the gateway speaks: requests validated, errors shaped as OpenAI's.

Requests are pydantic models with `extra="forbid"`: an argument OpenAI does not define is refused
(400, "Unrecognized request argument supplied"), as OpenAI refuses it, never ignored. Arguments that
OpenAI defines but that would change what the policy samples from without the trainer knowing
(penalties, a logit bias, a response format other than text, top log-probs) are refused by name
with a 400 that says so, not silently dropped.

Every error is `GatewayError(status, message, type, param, code)`, written as OpenAI writes errors:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

Messages are compared and rendered in one normal form (`normal_message`): roles as the chat template
knows them (`developer` is `system`), text content as one string, tool-call arguments decoded from
their JSON string (templates write them with `tojson`), empty fields dropped.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.env.parsers import decode_json_whole


class GatewayError(Exception):
    """An error the gateway answers with (`status` and OpenAI's error JSON); never a traceback."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def session_not_found() -> GatewayError:
    # One answer for a token never issued, one of another gateway and a finished session: which of
    # them it was is nobody's business but the gateway's.
    return GatewayError(
        404,
        "No such session: the session token is unknown or its episode is over. Each episode has its own "
        "session URL; use the one your harness was given for this episode.",
        type="invalid_request_error",
        code="session_not_found",
    )


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str = ""


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None
    """Set by clients that replay streamed deltas as they came; not part of the message."""


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    """Reasoning a harness sends back beside the content (vLLM's and DeepSeek's field), for templates that render it."""
    # Fields the openai SDK writes back when a harness appends `message.model_dump()`; they carry
    # nothing when empty, and are refused when they do.
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    annotations: list[Any] | None = None


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(_Strict):
    class _Name(_Strict):
        name: str

    type: Literal["function"]
    function: _Name


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ResponseFormat(_Strict):
    type: str
    json_schema: Any = None


class ChatCompletionRequest(_Strict):
    """`POST .../v1/chat/completions`: OpenAI's fields, each checked."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None


def parse_request(raw: bytes) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    """The request body as a checked `ChatCompletionRequest` (and the JSON object it came from), or a
    `GatewayError` (400) saying what is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GatewayError(
            400,
            f"We could not parse the JSON body of your request ({exc}). The body must be a JSON object.",
        ) from None
    except RecursionError:  # nested past the parser's depth: the client's error, not the server's
        raise GatewayError(400, "The JSON body of your request is nested too deeply to parse.") from None
    if not isinstance(data, dict):
        raise GatewayError(400, f"The request body must be a JSON object, got {type(data).__name__}.")
    _refuse_non_text(data.get("messages"))
    try:
        req = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise GatewayError(400, "The JSON body of your request is nested too deeply to check.") from None
    refuse_unsupported(req)
    return req, data


def _refuse_non_text(messages: Any) -> None:
    """Content parts other than text (images, audio, files), refused by name: the policy reads text only."""
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise non_text_part(f"messages[{i}].content[{j}]", kind, f"messages.{i}.content.{j}")


def non_text_part(where: str, kind: Any, param: str) -> GatewayError:
    return GatewayError(
        400,
        f"{where} is a content part of type {kind!r}: this model reads text only (no images, audio or files); "
        "send text parts ({'type': 'text', 'text': ...}) or a string.",
        param=param,
        code="unsupported_content",
    )


# Pydantic names the member of a union it tried inside an error's location; OpenAI's `param` does not.
_UNION_MEMBERS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param(loc: tuple[int | str, ...]) -> str:
    kept = []
    for part in loc:
        if isinstance(part, str) and (
            "[" in part or "-" in part or part[:1].isupper() or part in _UNION_MEMBERS
        ):
            continue
        kept.append(str(part))
    return ".".join(kept)


def validation_error(exc: ValidationError) -> GatewayError:
    """A request that does not validate, as OpenAI answers it: 400, naming the first bad parameter."""
    err = exc.errors(include_url=False)[0]
    loc = _param(err["loc"])
    if err["type"] == "extra_forbidden":
        return GatewayError(400, f"Unrecognized request argument supplied: {loc}", param=loc)
    if err["type"] == "missing":
        return GatewayError(400, f"Missing required parameter: '{loc}'.", param=loc)
    return GatewayError(400, f"Invalid value for '{loc}': {err['msg']}.", param=loc)


def refuse_unsupported(req: ChatCompletionRequest) -> None:
    """OpenAI arguments this gateway does not honour, refused by name (a sample from another distribution
    than the policy's would be trained on as if it were the policy's)."""
    changes_distribution = {
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
    }
    for name, value in changes_distribution.items():
        if value not in (None, 0, 0.0):
            raise GatewayError(
                400,
                f"'{name}' is not supported: the gateway samples from the policy's own distribution. Leave it unset.",
                param=name,
            )
    if req.logit_bias:
        raise GatewayError(
            400,
            "'logit_bias' is not supported: the gateway samples from the policy's own distribution.",
            param="logit_bias",
        )
    if req.response_format is not None and req.response_format.type != "text":
        raise GatewayError(
            400,
            f"response_format {req.response_format.type!r} is not supported (no constrained decoding: it would "
            "change the sampled distribution); use {'type': 'text'} or leave it unset.",
            param="response_format",
        )
    if req.top_logprobs:
        raise GatewayError(
            400,
            "'top_logprobs' above 0 is not supported: the engine reports the sampled token's log-prob only.",
            param="top_logprobs",
        )
    if isinstance(req.stop, list) and len(req.stop) > 4:
        raise GatewayError(400, f"'stop' takes at most 4 sequences, got {len(req.stop)}.", param="stop")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if any(not s for s in stops):
        raise GatewayError(400, "'stop' sequences must be non-empty strings.", param="stop")
    for i, m in enumerate(req.messages):
        if m.refusal or m.audio or m.function_call:
            field = "refusal" if m.refusal else "audio" if m.audio else "function_call"
            raise GatewayError(
                400,
                f"messages[{i}].{field} is not supported: send the message's text as 'content' and calls as 'tool_calls'.",
                param=f"messages.{i}.{field}",
            )
        if m.role == "tool" and m.content is None:
            raise GatewayError(
                400, f"messages[{i}]: a tool message needs 'content'.", param=f"messages.{i}.content"
            )
    if isinstance(req.tool_choice, NamedToolChoice):
        names = {t.function.name for t in req.tools or []}
        if req.tool_choice.function.name not in names:
            raise GatewayError(
                400,
                f"tool_choice names the function {req.tool_choice.function.name!r}, which is not in 'tools'.",
                param="tool_choice",
            )
    elif req.tool_choice == "required" and not req.tools:
        raise GatewayError(400, "tool_choice 'required' needs 'tools'.", param="tool_choice")


# --- the normal form of messages ------------------------------------------------------------------------


def _text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def decoded_arguments(arguments: str) -> Any:
    """A tool call's arguments as the template writes them: the decoded JSON object, else the string as is."""
    if not arguments.strip():
        return {}
    value, error = decode_json_whole(arguments)
    return arguments if error is not None else value


def normal_message(m: ChatMessage) -> dict[str, Any]:
    """One message in the gateway's normal form: what is compared between calls and what the template renders."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id or "",
                "type": "function",
                "function": {"name": c.function.name, "arguments": decoded_arguments(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


def reply_key(message: dict[str, Any]) -> str:
    """What identifies an assistant reply when a harness sends it back: its text and its calls (names and
    decoded arguments). Call ids are left out: the sampled tokens never held them, and harnesses renumber."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return json.dumps(
        {
            "content": message.get("content", ""),
            "calls": calls,
            "reasoning": message.get("reasoning_content"),
        },
        sort_keys=True,
        ensure_ascii=False,
    )


def message_key(message: dict[str, Any]) -> str:
    """A message's normal form as one canonical string (for prefix hashing)."""
    return json.dumps(message, sort_keys=True, ensure_ascii=False)
