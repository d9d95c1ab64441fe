"""The gateway: an OpenAI-compatible server in front of the policy engine, so that agents written against
the OpenAI API play (and are trained on) episodes, token-exact.

- `server`: `Gateway`, the HTTP server (FastAPI on uvicorn) and its routes, one session URL per episode;
- `session`: `Session`, one episode's calls captured (prompt ids, sampled ids, log-probs, policy
  version) and stitched into trajectories, with branches where the history drifted;
- `protocol`: the OpenAI request and error formats; `dialects`: the Responses and Anthropic Messages APIs,
  translated to and from it;
- `harness`: `HarnessEnv`, an environment whose episodes a user's agent plays through a session: a
  callable on the host, or a command inside the sandbox (`SandboxCommand`);
- `relay`: a sandbox command's only way out, to its session, over the sandbox's own stdio;
- `images`: sandbox images with a harness's packages installed from the package index.

Names are imported lazily: `import agentrl.gateway` does not load the web server.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Gateway": "agentrl.gateway.server",
    "shared_gateway": "agentrl.gateway.server",
    "Session": "agentrl.gateway.session",
    "GATEWAY_METRICS": "agentrl.gateway.session",
    "GatewayError": "agentrl.gateway.protocol",
    "HarnessEnv": "agentrl.gateway.harness",
    "HarnessTask": "agentrl.gateway.harness",
    "SandboxCommand": "agentrl.gateway.harness",
    "tool_loop_agent": "agentrl.gateway.harness",
    "responses_loop_agent": "agentrl.gateway.harness",
    "messages_loop_agent": "agentrl.gateway.harness",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl.gateway' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
