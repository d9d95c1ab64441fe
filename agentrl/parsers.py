"""Tool-call parsers: the model's text in, the tool calls it asked for (and what was wrong) out.

`hermes` reads the Hermes/Qwen format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number of them in one message (parallel calls). `llama3-json` reads Llama 3.1's JSON tool
calls (`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several
separated by `;`). Register others with `register_parser(name, cls)`.

A parser never raises on model output: every problem is a `ParseError` the environment turns
into an observation the model can read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass(frozen=True)
class ParseError:
    message: str
    raw: str


@dataclass(frozen=True)
class ParsedAction:
    """What one assistant message asked for. `content` is the text outside the tool calls."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    content: str = ""


class ToolCallParser(Protocol):
    name: str
    format_hint: str

    def parse(self, text: str) -> ParsedAction: ...


def _call_from_obj(obj: Any, raw: str, args_key: str) -> ToolCall | ParseError:
    if not isinstance(obj, dict):
        return ParseError(f"a tool call must be a JSON object, got {type(obj).__name__}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParseError('a tool call needs a "name" string', raw)
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON-encoded string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ParseError(f'"{args_key}" is a string that is not valid JSON ({exc.msg})', raw)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParseError(f'"{args_key}" must be a JSON object, got {type(args).__name__}', raw)
    return ToolCall(name=name, arguments=args)


def _short(raw: str, limit: int = 200) -> str:
    return raw if len(raw) <= limit else raw[:limit] + "..."


class HermesParser:
    name = "hermes"
    format_hint = '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)

    def parse(self, text: str) -> ParsedAction:
        calls: list[ToolCall] = []
        errors: list[ParseError] = []
        for i, m in enumerate(self._block.finditer(text)):
            raw = m.group(1).strip()
            if not m.group(0).endswith("</tool_call>"):
                errors.append(ParseError("unterminated <tool_call>: close it with </tool_call>", _short(raw)))
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                errors.append(
                    ParseError(f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})", _short(raw))
                )
                continue
            call = _call_from_obj(obj, _short(raw), "arguments")
            if isinstance(call, ParseError):
                errors.append(call)
            else:
                calls.append(ToolCall(call.name, call.arguments, id=f"call_{i}"))
        content = self._block.sub("", text).strip()
        return ParsedAction(calls, errors, content)


class Llama3JsonParser:
    name = "llama3-json"
    format_hint = '{"name": "<tool name>", "parameters": {<arguments as JSON>}}'

    def parse(self, text: str) -> ParsedAction:
        body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
        body = body.replace("<|eom_id|>", "").replace("<|eot_id|>", "").strip()
        if not body.startswith("{"):
            return ParsedAction([], [], text.strip())
        calls: list[ToolCall] = []
        errors: list[ParseError] = []
        decoder = json.JSONDecoder()
        pos, i = 0, 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                errors.append(ParseError(f"the tool call is not valid JSON ({exc.msg})", _short(body[pos:])))
                break
            call = _call_from_obj(obj, _short(body[pos:end]), "parameters")
            if isinstance(call, ParseError):
                errors.append(call)
            else:
                calls.append(ToolCall(call.name, call.arguments, id=f"call_{i}"))
            i += 1
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return ParsedAction(calls, errors, "")


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3-json": Llama3JsonParser}


def register_parser(name: str, cls: type) -> None:
    if name in PARSERS:
        raise ValueError(f"a tool-call parser named {name!r} is already registered")
    PARSERS[name] = cls


def get_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; registered: {sorted(PARSERS)}")
    return PARSERS[name]()
