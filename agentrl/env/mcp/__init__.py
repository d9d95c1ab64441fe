"""Tools from MCP servers: an environment names its servers, its agent gets their tools.

    env = agentrl.ToolEnv(tasks=..., tools=["submit"], verifier="numeric",
                          mcp_servers=[agentrl.MCPServer(command=["mcp-server-sqlite", "--db-path", "/workspace/shop.db"])])

Modules: `server` (`MCPServer`, how a server is named), `client` (the connections of one episode: started
at reset, called with the env's deadlines, closed with the episode), `tools` (a server's tools as agentrl
`Tool`s: its schemas, its results as observations), `images` (the sandbox image with the reference
servers installed). docs/ENVIRONMENTS.md, "Tools from an MCP server", says how to use them.
"""

from agentrl.env.mcp.server import MCPServer

__all__ = ["MCPServer"]
