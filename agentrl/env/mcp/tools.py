"""An MCP server's tools as agentrl `Tool`s: the server's schema, its arguments checked against it, its
results as the model's observation.

- The schema the model reads is the server's `inputSchema`, as the server listed it (titles dropped, as
  for `@tool` functions); arguments are validated against it with `jsonschema` before the call, and a
  call that fails is refused (`invalid_arguments`, nothing sent to the server).
- The call's deadline is the env's (`exec_timeout_s`, what is left of the step's budget): past it the call
  is cancelled and the model reads a timeout, unless the server stopped answering (the episode ends).
- The result's content becomes text: text items as they are, images and audio as a one-line note (the
  model reads text), embedded resources by their text, links by their URI, `structuredContent` as JSON
  when nothing else came; clipped like any tool's output. `isError` results are tool errors.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from agentrl.env.mcp.client import MCPCallTimeout, MCPConnection
from agentrl.env.mcp.server import MCPServer
from agentrl.env.tools import Tool, ToolContext, ToolError, ToolOutcome, clip_observation


class _AnyArguments(BaseModel):
    """`Tool.params_model` of an MCP tool: the server's JSON schema checks the arguments (`check_arguments`)."""

    model_config = ConfigDict(extra="allow")


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


def _validator(schema: dict[str, Any]) -> Any:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError:
        return None  # the server's own schema is broken: it checks its arguments itself
    return cls(schema)


def _checker(tool_name: str, schema: dict[str, Any]) -> Any:
    validator = _validator(schema)

    def check(arguments: dict[str, Any]) -> dict[str, Any]:
        if validator is not None:
            errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
            if errors:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in e.absolute_path) or '(arguments)'}: {e.message[:300]}"
                    for e in errors[:5]
                )
                raise ToolError(problems)
        return {"arguments": arguments}

    return check


def render_result(result: Any) -> tuple[str, bool]:
    """A `CallToolResult` as (the text the model reads, whether it is an error)."""
    parts: list[str] = []
    for item in result.content or []:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind in ("image", "audio"):
            size = len(item.data or "") * 3 // 4
            parts.append(f"[{kind}: {item.mime_type}, about {size} bytes, not shown]")
        elif kind == "resource":
            res = item.resource
            text = getattr(res, "text", None)
            parts.append(
                f"[resource {res.uri}]\n{text}"
                if text is not None
                else f"[resource {res.uri}: binary, not shown]"
            )
        elif kind == "resource_link":
            parts.append(f"[resource link: {item.uri}]")
        else:
            parts.append(f"[{kind or 'unknown'} content, not shown]")
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts) if parts else "[no output]"
    return clip_observation(text), bool(result.is_error)


def mcp_tool(conn: MCPConnection, listed: Any) -> Tool:
    """One listed tool of `conn`'s server as an agentrl `Tool` (see the module docstring)."""
    name = conn.spec.prefix + listed.name
    schema = listed.input_schema if isinstance(listed.input_schema, dict) else {"type": "object"}
    parameters = _strip_titles(schema)
    parameters.setdefault("type", "object")
    parameters.setdefault("properties", {})
    description = (listed.description or getattr(listed, "title", None) or listed.name).strip()

    def call(ctx: ToolContext, arguments: dict[str, Any]) -> ToolOutcome:
        timeout_s = ctx.exec_timeout_s
        t0 = time.perf_counter()
        try:
            result = conn.call(listed.name, arguments, timeout_s)
        except MCPCallTimeout as exc:
            return ToolOutcome(
                f"[timed out after {timeout_s:g}s: {exc}; the call was cancelled]",
                is_error=True,
                timed_out=True,
                duration_s=timeout_s,
            )
        content, is_error = render_result(result)
        return ToolOutcome(content, is_error=is_error, duration_s=time.perf_counter() - t0)

    call.__name__ = name
    return Tool(
        name=name,
        description=description,
        fn=call,
        params_model=_AnyArguments,
        parameters=parameters,
        needs_sandbox=conn.spec.in_sandbox,
        check_arguments=_checker(name, schema),
    )


def tools_of(conn: MCPConnection) -> list[Tool]:
    """Every tool `conn`'s server listed (the ones its spec keeps), as agentrl tools."""
    return [mcp_tool(conn, t) for t in conn.tools]


class MCPTools:
    """The MCP servers of one episode: connected at reset, their tools as agentrl `Tool`s, closed with it."""

    def __init__(self, connections: list[MCPConnection], tools: list[Any]):
        self.connections = connections
        self.tools = tools

    @classmethod
    def start(cls, servers: list[MCPServer], sandbox: Any = None) -> MCPTools:
        # Started side by side: a server's start is mostly its interpreter importing the SDK.
        results: list[MCPConnection | BaseException | None] = [None] * len(servers)

        def open_one(i: int) -> None:
            try:
                results[i] = MCPConnection.open(servers[i], sandbox)
            except BaseException as exc:
                results[i] = exc

        threads = [threading.Thread(target=open_one, args=(i,), daemon=True) for i in range(len(servers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        connections = [r for r in results if isinstance(r, MCPConnection)]
        failed = next((r for r in results if not isinstance(r, MCPConnection)), None)
        try:
            if failed is not None:
                raise (
                    failed
                    if isinstance(failed, BaseException)
                    else RuntimeError("an MCP server did not start")
                )
            tools = [t for c in connections for t in tools_of(c)]
        except BaseException:
            for c in connections:
                c.close()
            raise
        return cls(connections, tools)

    def close(self) -> None:
        for c in self.connections:
            c.close()
