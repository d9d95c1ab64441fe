"""The Responses API and Anthropic's Messages API, each translated to and from one chat-completions request,
so that one session logic (`agentrl.gateway.session`) serves every dialect: the same prompts, the same
token-exact, branch-aware trajectories, whichever API an agent speaks.

- Responses (`POST .../v1/responses`): `input` as a string or items (messages with `input_text` /
  `output_text` parts, `function_call`, `function_call_output`), `instructions`, function `tools`,
  `tool_choice`, `parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p`, `stream` (the
  Responses events), and `previous_response_id`: a response of the same session continues where it ended
  (the session keeps its responses while it is open; another session's id is a 404).
- Messages (`POST .../v1/messages`, Anthropic's base URL being the session's without `/v1`): `system`,
  `messages` of content blocks (`text`, `tool_use`, `tool_result`), `tools` with `input_schema`,
  `tool_choice` (`auto`, `any`, `tool`, `none`, `disable_parallel_tool_use`), `max_tokens`,
  `stop_sequences`, `temperature`, `top_p`, `stream` (Anthropic's events).

A reply sent back in either dialect is the assistant message the gateway returned (the same text, the same
calls), so a conversation that goes on extends its sampled ids exactly as in chat completions. Each dialect
answers errors in its own shape (Anthropic: `{"type": "error", "error": {...}}`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from agentrl.gateway.protocol import (
    ChatCompletionRequest,
    GatewayError,
    non_text_part,
    validation_error,
)
from agentrl.gateway.session import Choice, Completion, random_hex, text_pieces

# --- shared --------------------------------------------------------------------------------------------


def _object(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"We could not parse the JSON body of your request ({exc}).") from None
    if not isinstance(data, dict):
        raise GatewayError(400, f"The request body must be a JSON object, got {type(data).__name__}.")
    return data


def _check_fields(data: dict[str, Any], known: set[str], ignored: set[str], refused: dict[str, Any]) -> None:
    """Unknown fields are refused; `ignored` ones (bookkeeping that changes no sample) are accepted;
    `refused` maps a field to the one value it may take (anything else would change what is sampled,
    or is a feature the gateway does not have)."""
    for name in data:
        if name not in known and name not in ignored and name not in refused:
            raise GatewayError(400, f"Unrecognized request argument supplied: {name}", param=name)
    for name, allowed in refused.items():
        value = data.get(name)
        if value is not None and value != allowed and not (callable(allowed) and allowed(value)):
            raise GatewayError(
                400,
                f"'{name}' is not supported by this gateway (it samples from the policy's own distribution, text "
                f"only, with no server-side state beyond the session); leave it unset.",
                param=name,
            )


def _chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    from pydantic import ValidationError

    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _text_of(parts: Any, where: str, param: str, kinds: tuple[str, ...]) -> str:
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise GatewayError(400, f"{where} must be a string or a list of parts.", param=param)
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            if kind in ("input_image", "input_file", "input_audio", "image", "document", "image_url"):
                raise non_text_part(f"{where}[{j}]", kind, f"{param}.{j}")
            raise GatewayError(400, f"{where}[{j}] has an unknown part type {kind!r}.", param=f"{param}.{j}")
        text = part.get("text")
        if not isinstance(text, str):
            raise GatewayError(400, f"{where}[{j}] needs a 'text' string.", param=f"{param}.{j}.text")
        out.append(text)
    return "".join(out)


def _arguments(call: dict[str, Any]) -> str:
    return call["function"]["arguments"]


def _sse(event: str | None, body: dict[str, Any]) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


def _logprobs(
    ch: Choice, decode: Callable[[list[int]], str], ids: list[int] | None = None, start: int = 0
) -> list[dict[str, Any]]:
    ids = ch.content_ids if ids is None else ids
    out = []
    for tok, lp in zip(ids, ch.sample.logprobs[start : start + len(ids)], strict=False):
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


# --- Responses -----------------------------------------------------------------------------------------

_RESPONSES_KNOWN = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "previous_response_id",
}
_RESPONSES_IGNORED = {
    "store",
    "metadata",
    "user",
    "include",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "service_tier",
    "stream_options",
    "truncation",
}
_RESPONSES_REFUSED: dict[str, Any] = {
    "background": False,
    "conversation": None,
    "prompt": None,
    "max_tool_calls": None,
    "top_logprobs": 0,
    "reasoning": lambda r: isinstance(r, dict) and not r.get("effort") and not r.get("summary"),
    "text": lambda t: isinstance(t, dict) and (t.get("format") or {"type": "text"}).get("type") == "text",
}


class ResponsesRequest:
    """A `POST /responses` body, translated: `chat` is the chat-completions request the session serves."""

    def __init__(self, chat: ChatCompletionRequest, tools: list[dict[str, Any]] | None, data: dict[str, Any]):
        self.chat, self.tools, self.data = chat, tools, data
        self.stream = bool(data.get("stream"))


def parse_responses(raw: bytes, history: Callable[[str], list[dict[str, Any]]]) -> ResponsesRequest:
    """`history(previous_response_id)` is that response's conversation (its messages and its reply), or a
    `GatewayError` where the session holds no such response."""
    data = _object(raw)
    _check_fields(data, _RESPONSES_KNOWN, _RESPONSES_IGNORED, _RESPONSES_REFUSED)
    if "model" not in data:
        raise GatewayError(400, "Missing required parameter: 'model'.", param="model")
    tools = _responses_tools(data.get("tools"))
    messages: list[dict[str, Any]] = []
    if data.get("instructions"):
        messages.append({"role": "system", "content": str(data["instructions"])})
    previous = data.get("previous_response_id")
    if previous:
        messages += history(str(previous))
    messages += _responses_input(data.get("input"))
    if not messages:
        raise GatewayError(400, "Missing required parameter: 'input'.", param="input")
    choice = data.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise GatewayError(
                400,
                "tool_choice takes 'auto', 'none', 'required' or {'type': 'function', 'name': ...}.",
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fields = {
        "model": data["model"],
        "messages": messages,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": data.get("parallel_tool_calls"),
        "max_completion_tokens": data.get("max_output_tokens"),
        "temperature": data.get("temperature"),
        "top_p": data.get("top_p"),
        "logprobs": True,
    }
    chat = _chat_request({k: v for k, v in fields.items() if v is not None})
    from agentrl.gateway.protocol import refuse_unsupported

    refuse_unsupported(chat)
    return ResponsesRequest(chat, tools, data)


def _responses_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise GatewayError(400, "'tools' must be a list.", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise GatewayError(
                400,
                f"tools[{i}] is of type {kind!r}: only function tools are supported (the environment runs them).",
                param=f"tools.{i}",
            )
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict", "defer_loading"}
        if unknown:
            raise GatewayError(400, f"tools[{i}] has unknown fields {sorted(unknown)}.", param=f"tools.{i}")
        function = {"name": tool.get("name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("parameters") is not None:
            function["parameters"] = tool["parameters"]
        out.append({"type": "function", "function": function})
    return out


def _responses_input(items: Any) -> list[dict[str, Any]]:
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise GatewayError(400, "'input' must be a string or a list of items.", param="input")
    messages: list[dict[str, Any]] = []
    joinable = (
        False  # whether a function call goes into the previous assistant message (one turn: text, calls)
    )
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise GatewayError(400, f"input[{i}] must be an object.", param=f"input.{i}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise GatewayError(400, f"input[{i}] has an unknown role {role!r}.", param=f"input.{i}.role")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text", "text")
            text = _text_of(item.get("content"), f"input[{i}].content", f"input.{i}.content", kinds)
            messages.append({"role": role, "content": text})
            joinable = role == "assistant"
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""},
            }
            if joinable:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            joinable = True
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _text_of(
                    output, f"input[{i}].output", f"input.{i}.output", ("input_text", "output_text")
                )
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
            joinable = False
        elif kind == "reasoning":
            continue  # the gateway writes none; a harness that echoes an empty one back loses nothing
        else:
            raise GatewayError(
                400,
                f"input[{i}] is an item of type {kind!r}, which this gateway does not take.",
                param=f"input.{i}",
            )
    return messages


def response_id() -> str:
    return f"resp_{random_hex(48)}"


def response_output(ch: Choice, decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """The output items of one choice: its text as a message (with log-probs), then its function calls."""
    items: list[dict[str, Any]] = []
    message = ch.message
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content or not calls:
        items.append(
            {
                "type": "message",
                "id": f"msg_{random_hex(48)}",
                "status": "completed" if ch.finish_reason != "length" else "incomplete",
                "role": "assistant",
                "content": [
                    {
                        "type": "output_text",
                        "text": content or "",
                        "annotations": [],
                        "logprobs": _logprobs(ch, decode),
                    }
                ],
            }
        )
    for call in calls:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{random_hex(48)}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": _arguments(call),
                "status": "completed",
            }
        )
    return items


def response_json(
    req: ResponsesRequest, c: Completion, rid: str, model: str, output: list[dict[str, Any]], status: str
) -> dict[str, Any]:
    data = req.data
    ch = c.choices[0]
    out_tokens = len(ch.sample.sampled_ids)
    return {
        "id": rid,
        "object": "response",
        "created_at": c.created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if ch.finish_reason == "length" else None,
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": data.get("parallel_tool_calls", True),
        "previous_response_id": data.get("previous_response_id"),
        "reasoning": None,
        "store": data.get("store", True),
        "temperature": data.get("temperature", 1.0),
        "text": {"format": {"type": "text"}},
        "tool_choice": data.get("tool_choice", "auto"),
        "tools": data.get("tools") or [],
        "top_p": data.get("top_p", 1.0),
        "truncation": data.get("truncation", "disabled"),
        "usage": {
            "input_tokens": c.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": out_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.prompt_tokens + out_tokens,
        },
        "user": data.get("user"),
        "metadata": data.get("metadata") or {},
    }


async def responses_sse(
    req: ResponsesRequest, c: Completion, rid: str, model: str, decode: Callable[[list[int]], str]
) -> AsyncIterator[bytes]:
    """The Responses streaming events of a finished completion; the text deltas add up to the text and
    carry the log-probs of their tokens."""
    ch = c.choices[0]
    output = response_output(ch, decode)
    final = "incomplete" if ch.finish_reason == "length" else "completed"
    seq = iter(range(1 << 30))

    def event(kind: str, **body: Any) -> bytes:
        return _sse(kind, {"type": kind, "sequence_number": next(seq), **body})

    yield event("response.created", response=response_json(req, c, rid, model, [], "in_progress"))
    yield event("response.in_progress", response=response_json(req, c, rid, model, [], "in_progress"))
    for index, item in enumerate(output):
        if item["type"] == "message":
            for chunk in _message_item_events(event, index, item, ch, decode):
                yield chunk
        else:
            for chunk in _function_call_events(event, index, item):
                yield chunk
        yield event("response.output_item.done", output_index=index, item=item)
    kind = "response.completed" if final == "completed" else "response.incomplete"
    yield event(kind, response=response_json(req, c, rid, model, output, final))


def _message_item_events(
    event: Callable[..., bytes],
    index: int,
    item: dict[str, Any],
    ch: Choice,
    decode: Callable[[list[int]], str],
) -> Iterator[bytes]:
    """A message output item's events, up to its content part's end: its text in deltas, each with its
    tokens' log-probs (one delta when the reply also calls tools)."""
    part = item["content"][0]
    yield event(
        "response.output_item.added",
        output_index=index,
        item={**item, "status": "in_progress", "content": []},
    )
    empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield event(
        "response.content_part.added",
        item_id=item["id"],
        output_index=index,
        content_index=0,
        part=empty,
    )
    offset = 0
    pieces = text_pieces(ch, decode) if not ch.message.get("tool_calls") else [(part["text"], ch.content_ids)]
    for text, ids in pieces:
        lps = _logprobs(ch, decode, ids, offset)
        offset += len(ids)
        yield event(
            "response.output_text.delta",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            delta=text,
            logprobs=lps,
        )
    yield event(
        "response.output_text.done",
        item_id=item["id"],
        output_index=index,
        content_index=0,
        text=part["text"],
        logprobs=part["logprobs"],
    )
    yield event(
        "response.content_part.done",
        item_id=item["id"],
        output_index=index,
        content_index=0,
        part=part,
    )


def _function_call_events(event: Callable[..., bytes], index: int, item: dict[str, Any]) -> Iterator[bytes]:
    """A function call output item's events, up to its arguments' end: the arguments in one delta."""
    yield event(
        "response.output_item.added",
        output_index=index,
        item={**item, "arguments": "", "status": "in_progress"},
    )
    yield event(
        "response.function_call_arguments.delta",
        item_id=item["id"],
        output_index=index,
        delta=item["arguments"],
    )
    yield event(
        "response.function_call_arguments.done",
        item_id=item["id"],
        output_index=index,
        name=item["name"],
        arguments=item["arguments"],
    )


# --- Anthropic Messages --------------------------------------------------------------------------------

_MESSAGES_KNOWN = {
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "stream",
}
_MESSAGES_IGNORED = {"metadata", "service_tier", "container", "context_management", "mcp_servers"}
_MESSAGES_REFUSED: dict[str, Any] = {
    "top_k": lambda k: k in (0, -1),
    "thinking": lambda t: isinstance(t, dict) and t.get("type") == "disabled",
}


class MessagesRequest:
    def __init__(self, chat: ChatCompletionRequest, tools: list[dict[str, Any]] | None, data: dict[str, Any]):
        self.chat, self.tools, self.data = chat, tools, data
        self.stream = bool(data.get("stream"))


def parse_messages(raw: bytes, max_tokens_limit: int) -> MessagesRequest:
    """A `POST /v1/messages` body as the chat request the session serves. Its required `max_tokens` is clipped
    to the session's per-completion limit (`stop_reason` "max_tokens" says where it cut), since Anthropic's
    clients always send one."""
    data = _object(raw)
    _check_fields(data, _MESSAGES_KNOWN, _MESSAGES_IGNORED, _MESSAGES_REFUSED)
    for name in ("model", "messages", "max_tokens"):
        if name not in data:
            raise GatewayError(400, f"{name}: Field required", param=name)
    max_tokens = data["max_tokens"]
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise GatewayError(400, "max_tokens: must be a positive integer", param="max_tokens")
    messages: list[dict[str, Any]] = []
    system = data.get("system")
    if system:
        messages.append({"role": "system", "content": _text_of(system, "system", "system", ("text",))})
    raw_messages = data["messages"]
    if not isinstance(raw_messages, list) or not raw_messages:
        raise GatewayError(400, "messages: at least one message is required", param="messages")
    for i, m in enumerate(raw_messages):
        messages += _anthropic_message(m, i)
    tools = _anthropic_tools(data.get("tools"))
    choice: Any = None
    parallel = None
    tc = data.get("tool_choice")
    if tc is not None:
        kind = tc.get("type") if isinstance(tc, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise GatewayError(400, "tool_choice.type must be auto, any, tool or none", param="tool_choice")
        if tc.get("disable_parallel_tool_use"):
            parallel = False
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            choice = {"type": "function", "function": {"name": tc.get("name")}}
    stops = data.get("stop_sequences")
    fields = {
        "model": data["model"],
        "messages": messages,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "max_tokens": min(max_tokens, max_tokens_limit),
        "temperature": data.get("temperature"),
        "top_p": data.get("top_p"),
        "stop": stops or None,
    }
    if fields["temperature"] is not None and fields["temperature"] > 1:
        raise GatewayError(400, "temperature: must be at most 1", param="temperature")
    chat = _chat_request({k: v for k, v in fields.items() if v is not None})
    from agentrl.gateway.protocol import refuse_unsupported

    refuse_unsupported(chat)
    return MessagesRequest(chat, tools, data)


def _anthropic_message(m: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise GatewayError(
            400, f"messages.{i}.role: must be 'user' or 'assistant'", param=f"messages.{i}.role"
        )
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise GatewayError(
            400, f"messages.{i}.content: must be a string or a list of blocks", param=f"messages.{i}"
        )
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages.{i}.content.{j}"
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {
                        "name": block.get("name"),
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text_of(result, where, where, ("text",))
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # the gateway writes none
        elif kind in ("image", "document"):
            raise non_text_part(where, kind, where)
        else:
            raise GatewayError(
                400, f"{where}: a block of type {kind!r} cannot be in a {role} message", param=where
            )
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            out["tool_calls"] = calls
        return [out]
    return [*results, *([{"role": "user", "content": "".join(texts)}] if texts or not results else [])]


def _anthropic_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise GatewayError(400, "tools: must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or "input_schema" not in tool
            or tool.get("type") not in (None, "custom")
        ):
            raise GatewayError(
                400,
                f"tools.{i}: only client tools with an input_schema are supported (the environment runs them)",
                param=f"tools.{i}",
            )
        function = {"name": tool.get("name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out


_STOP_REASON = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def anthropic_content(ch: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if ch.message.get("content"):
        blocks.append({"type": "text", "text": ch.message["content"]})
    for call in ch.message.get("tool_calls") or []:
        try:
            arguments = json.loads(_arguments(call))
        except ValueError:
            arguments = {}
        blocks.append(
            {
                "type": "tool_use",
                "id": "toolu_" + call["id"].removeprefix("call_"),
                "name": call["function"]["name"],
                "input": arguments,
            }
        )
    return blocks


def _stop(req: MessagesRequest, ch: Choice) -> tuple[str, str | None]:
    stops = req.chat.stop
    if ch.finish_reason == "stop" and stops and ch.sample.action_text != (ch.message.get("content") or ""):
        text = ch.sample.action_text[len(ch.message.get("content") or "") :]
        hit = next((s for s in ([stops] if isinstance(stops, str) else stops) if text.startswith(s)), None)
        if hit is not None:
            return "stop_sequence", hit
    return _STOP_REASON[ch.finish_reason], None


def message_json(req: MessagesRequest, c: Completion, model: str) -> dict[str, Any]:
    ch = c.choices[0]
    reason, sequence = _stop(req, ch)
    return {
        "id": f"msg_{random_hex(24)}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": anthropic_content(ch),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": c.prompt_tokens, "output_tokens": len(ch.sample.sampled_ids)},
    }


async def messages_sse(req: MessagesRequest, c: Completion, model: str) -> AsyncIterator[bytes]:
    body = message_json(req, c, model)
    start = {**body, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {"input_tokens": c.prompt_tokens, "output_tokens": 0}
    yield _sse("message_start", {"type": "message_start", "message": start})
    for index, block in enumerate(body["content"]):
        if block["type"] == "text":
            yield _sse(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {"type": "text", "text": ""},
                },
            )
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            yield _sse(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
            )
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }
        yield _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
    yield _sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]},
            "usage": {"output_tokens": body["usage"]["output_tokens"]},
        },
    )
    yield _sse("message_stop", {"type": "message_stop"})


def anthropic_error(exc: GatewayError) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}.get(
        exc.status, "api_error" if exc.status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def now() -> int:
    return int(time.time())
