"""Tool-call formats: each owns its format in all three directions.

- `system_block(schemas)`: the part of the system prompt that advertises the tools and says how to
  call them (what the model is told);
- `render_calls(calls)` / `render_call(tool, **arguments)`: calls written in the format (what
  oracles, demonstrations, the checks and the audit's attacks send);
- `parse(text)`: the model's text in, the tool calls it asked for (and what was wrong) out.

`hermes` is the Hermes/Qwen format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number of them in one message (parallel calls). `llama3-json` is Llama 3.1's JSON tool
calling (`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several
separated by `;`). An environment takes one by name (`ToolEnv(parser="llama3-json")`); register
others with `register_parser(name, cls)` (subclass `ToolCallFormat`).

A parser never raises on model output: every problem is a `ParseError` the environment turns
into an observation the model can read. JSON from the model is decoded by `decode_json`, which
refuses what would hurt later rather than here: nesting deeper than `MAX_JSON_DEPTH` (Python's
decoder recurses, and so does everything that walks the result), `NaN`/`Infinity` and numbers
that overflow to infinity (not JSON), integers longer than Python converts, and lone UTF-16
surrogates (`"\\ud800"`: a string that cannot be encoded, so it would break the sandbox call,
the tokenizer or the trajectory file instead).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentrl.core.errors import UserError, did_you_mean


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
    """A tool-call format (see the module docstring): what `ToolEnv(parser=...)` names."""

    name: str
    format_hint: str
    """One call, as error observations show the model how to write it."""

    def system_block(self, schemas: list[dict[str, Any]]) -> str: ...

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str: ...

    def render_call(self, tool: str, /, **arguments: Any) -> str: ...

    def parse(self, text: str) -> ParsedAction: ...


class ToolCallFormat:
    """Base of a tool-call format: a subclass gives `name`, `format_hint`, `render_calls`, `parse` and,
    unless the Hermes/Qwen preamble suits it, `system_block`."""

    name = ""
    format_hint = ""

    def system_block(self, schemas: list[dict[str, Any]]) -> str:
        """The Hermes/Qwen tool preamble (schemas inside <tools></tools>, one JSON object per line),
        ending with how one call looks in this format."""
        lines = "\n".join(json.dumps(s, separators=(", ", ": ")) for s in schemas)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a JSON object with the function name and arguments like this:\n"
            f"{self.format_hint}"
        )

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """`calls` ((tool name, arguments) pairs) as one message in this format."""
        raise NotImplementedError(f"the tool-call format {self.name!r} cannot write calls")

    def render_call(self, tool: str, /, **arguments: Any) -> str:
        """One call, as a model trained on this format writes it."""
        return self.render_calls([(tool, arguments)])

    def parse(self, text: str) -> ParsedAction:
        raise NotImplementedError


# Far deeper than any tool's arguments, far below Python's recursion limit (1000), which the
# decoder and every later walk of the arguments (validation, logging, templates) would hit.
MAX_JSON_DEPTH = 32
# Python refuses to convert longer integer strings (sys.get_int_max_str_digits()); say it plainly.
MAX_INT_DIGITS = 4300

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str, stop_above: int = MAX_JSON_DEPTH) -> int:
    """How deeply the arrays and objects in JSON `text` nest (brackets inside strings do not count).

    Stops counting once past `stop_above`: the answer is then "too deep", whatever the rest holds.
    """
    depth = deepest = 0
    for ch in _JSON_BRACKET.findall(_JSON_STRING.sub("", text)):
        if ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_above:
                    break
        else:
            depth -= 1
    return deepest


class _Refused(ValueError):
    """Valid-looking JSON we refuse (NaN, an infinite or endless number); the message is for the model."""


def _no_constants(name: str) -> Any:
    raise _Refused(f"{name} is not JSON; write a number or a string")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"the number {text[:40]}{'...' if len(text) > 40 else ''} is too large for a float")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer has {digits} digits; the limit is {MAX_INT_DIGITS}")
    return int(text)


# strict=False: a raw control character inside a string (a tab, or what a grammar-constrained sampler lets
# through) is taken as itself; the model's meaning is plain and nothing downstream is hurt by it.
_DECODER = json.JSONDecoder(
    parse_constant=_no_constants, parse_float=_finite_float, parse_int=_bounded_int, strict=False
)


def _lone_surrogate(value: Any) -> str | None:
    """The first string (key or value) in decoded JSON that UTF-8 cannot encode, shortened, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return ascii(item[:40])
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def decode_json(text: str, pos: int = 0, *, check_depth: bool = True) -> tuple[Any, int, str | None]:
    """Decode the JSON value that starts at `text[pos]` (leading whitespace allowed).

    Returns (value, end, None) or (None, pos, what is wrong as a verb phrase: "is not valid JSON
    (...)", "nests more than 32 levels deep; ..."); never raises. See the module docstring for what
    is refused and why. `check_depth=False` skips the depth scan when the caller already scanned a
    text that contains this one (the Llama 3 parser decodes several values from one text).
    """
    if check_depth and json_depth(text[pos:]) > MAX_JSON_DEPTH:
        return None, pos, f"nests more than {MAX_JSON_DEPTH} levels deep; flatten the arguments"
    start = pos
    while start < len(text) and text[start] in " \t\n\r":
        start += 1
    try:
        value, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as exc:
        return None, pos, f"is not valid JSON ({exc.msg} at char {exc.pos})"
    except _Refused as exc:
        return None, pos, f"is not valid JSON ({exc})"
    except (ValueError, RecursionError, MemoryError) as exc:  # belt and braces: still the model's input
        return None, pos, f"is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})"
    bad = _lone_surrogate(value)
    if bad is not None:
        return (
            None,
            pos,
            (
                f"holds a string with a lone UTF-16 surrogate ({bad}); write the character itself or a valid \\u escape pair"
            ),
        )
    return value, end, None


def decode_json_whole(text: str) -> tuple[Any, str | None]:
    """`decode_json` of all of `text` (only whitespace may follow the value)."""
    value, end, error = decode_json(text)
    if error is not None:
        return None, error
    rest = text[end:].strip()
    if rest:
        return None, f"is not valid JSON (Extra data at char {len(text) - len(text[end:].lstrip())})"
    return value, None


def _call_from_obj(obj: Any, raw: str, args_key: str) -> ToolCall | ParseError:
    if not isinstance(obj, dict):
        return ParseError(f"a tool call must be a JSON object, got {type(obj).__name__}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParseError('a tool call needs a "name" string', raw)
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON-encoded string
        if args.strip():
            args, error = decode_json_whole(args)
            if error is not None:
                return ParseError(f'"{args_key}" is a string that is not valid JSON: {error}', raw)
        else:
            args = {}
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParseError(f'"{args_key}" must be a JSON object, got {type(args).__name__}', raw)
    return ToolCall(name=name, arguments=args)


def _short(raw: str, limit: int = 200) -> str:
    return raw if len(raw) <= limit else raw[:limit] + "..."


class HermesParser(ToolCallFormat):
    name = "hermes"
    format_hint = '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(
            f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
            for name, arguments in calls
        )

    def parse(self, text: str) -> ParsedAction:
        calls: list[ToolCall] = []
        errors: list[ParseError] = []
        for i, m in enumerate(self._block.finditer(text)):
            raw = m.group(1).strip()
            if not m.group(0).endswith("</tool_call>"):
                errors.append(ParseError("unterminated <tool_call>: close it with </tool_call>", _short(raw)))
                continue
            obj, error = decode_json_whole(raw)
            if error is not None:
                errors.append(ParseError(f"the tool call {error}", _short(raw)))
                continue
            call = _call_from_obj(obj, _short(raw), "arguments")
            if isinstance(call, ParseError):
                errors.append(call)
            else:
                calls.append(ToolCall(call.name, call.arguments, id=f"call_{i}"))
        content = self._block.sub("", text).strip()
        return ParsedAction(calls, errors, content)


class Llama3JsonParser(ToolCallFormat):
    name = "llama3-json"
    format_hint = '{"name": "<tool name>", "parameters": {<arguments as JSON>}}'

    def system_block(self, schemas: list[dict[str, Any]]) -> str:
        """Llama 3.1's JSON tool-calling instructions (its chat template's wording), then each schema."""
        listed = "\n\n".join(json.dumps(s, indent=4) for s in schemas)
        return (
            "# Tools\n\nYou have access to the following functions. To call a function, please respond with "
            'JSON for a function call. Respond in the format {"name": function name, "parameters": '
            "dictionary of argument name and its value}. Do not use variables. Several calls go one after "
            f"another, separated by `;`.\n\n{listed}"
        )

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": name, "parameters": arguments}) for name, arguments in calls)

    def parse(self, text: str) -> ParsedAction:
        body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
        body = body.replace("<|eom_id|>", "").replace("<|eot_id|>", "").strip()
        if not body.startswith("{"):
            return ParsedAction([], [], text.strip())
        calls: list[ToolCall] = []
        errors: list[ParseError] = []
        pos, i = 0, 0
        while pos < len(body):
            # The first scan covers the whole body; later values start at a value boundary in it.
            obj, end, error = decode_json(body, pos, check_depth=i == 0)
            if error is not None:
                errors.append(ParseError(f"the tool call {error}", _short(body[pos:])))
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


class UnknownParserError(UserError, ValueError):
    """No tool-call format is registered under this name."""


def get_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise UnknownParserError(
            f"unknown tool-call parser {name!r}.{did_you_mean(name, PARSERS)} Registered: {', '.join(sorted(PARSERS))}"
        )
    parser = PARSERS[name]()
    missing = [
        m
        for m in ("system_block", "render_calls", "render_call", "parse")
        if not callable(getattr(parser, m, None))
    ]
    if missing:
        raise TypeError(
            f"tool-call parser {name!r} has no {', '.join(missing)}: a format advertises its tools, writes calls "
            "and parses them; subclass agentrl.env.parsers.ToolCallFormat"
        )
    return parser


HERMES = HermesParser()
"""The default format (`ToolEnv(parser="hermes")`): what scripted agents write when given none."""
