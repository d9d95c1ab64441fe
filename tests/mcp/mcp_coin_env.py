"""`agentrl/sqlite-mcp-v0` scored as a coin, for wiring tests of training on an MCP env.

Imported by id `tests.mcp.mcp_coin_env:test/SqliteMCPCoin-v0` (also from the trainer's subprocess). Every
episode starts the reference `mcp-server-sqlite` in its docker sandbox and offers its tools, exactly as
sqlite-mcp-v0 does; only the reward is the coin env's (an even-length first message): a random tiny model
never writes a working SQL call, and GRPO needs groups whose rewards differ to update at all.
"""

from __future__ import annotations

import agentrl
from agentrl.envs.sqlite_mcp import SqliteMCPEnv
from tests.coin_env import EvenLength


class SqliteMCPCoinEnv(SqliteMCPEnv):
    def __init__(self, **kw):
        kw.setdefault("max_turns", 1)
        super().__init__(verifier=EvenLength(), **kw)


agentrl.register(
    "test/SqliteMCPCoin-v0",
    "tests.mcp.mcp_coin_env:SqliteMCPCoinEnv",
    max_turns=1,
    description="sqlite-mcp-v0's episodes (the MCP server in docker), a coin's reward",
)
