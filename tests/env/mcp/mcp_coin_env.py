"""`agentrl/sqlite-mcp-v0` scored as a coin, for wiring tests of training on an MCP env.

Imported by id `tests.env.mcp.mcp_coin_env:test/SqliteMCPCoin-v0` (also from the trainer's subprocess). Every
episode starts the reference `mcp-server-sqlite` in its docker sandbox and offers its tools, exactly as
sqlite-mcp-v0 does; only the reward is a coin: a random tiny model never writes a working SQL call, and GRPO
needs groups whose rewards differ to update at all. The coin is the parity of the first message's code
points (its length's parity came out even for nearly every sample of the tiny model behind this prompt).
"""

from __future__ import annotations

import agentrl
from agentrl.core.types import Verdict
from agentrl.envs.sqlite_mcp import SqliteMCPEnv


class EvenCodePoints:
    name = "even-code-points"

    def verify(self, sandbox, task, episode):
        first = next((m["content"] for m in episode.messages if m["role"] == "assistant"), "")
        ok = sum(map(ord, first)) % 2 == 0
        return Verdict(
            float(ok), ok, f"first message's code points sum to {'an even' if ok else 'an odd'} number"
        )


class SqliteMCPCoinEnv(SqliteMCPEnv):
    def __init__(self, **kw):
        kw.setdefault("max_turns", 1)
        super().__init__(verifier=EvenCodePoints(), **kw)


agentrl.register(
    "test/SqliteMCPCoin-v0",
    "tests.env.mcp.mcp_coin_env:SqliteMCPCoinEnv",
    max_turns=1,
    description="sqlite-mcp-v0's episodes (the MCP server in docker), a coin's reward",
)
