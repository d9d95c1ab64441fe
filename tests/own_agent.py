"""A user's own agent, as a new user brings one: its own system prompt, its own tool schema (the
environment's `submit`, described its own way), the OpenAI SDK. It plays `test/Pick-v0` as
`test/PickOwnAgent-v0`; `test/PickOwnTools-v0` is the same agent with a tool of its own (`answer`) instead
of `submit`, so the environment's oracle, which submits, cannot be played through it.
"""

from __future__ import annotations

from typing import Any

import agentrl
import tests.coin_env  # noqa: F401  (registers test/Pick-v0)

SYSTEM = "You are WordBot. Read the request, then hand in exactly one word with the hand-in tool."

SUBMIT = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": "Hand in the word you were asked for.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The word."}},
            "required": ["answer"],
        },
    },
}

ANSWER = {
    "type": "function",
    "function": {
        "name": "answer",
        "description": "Say the word.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


def agent_with(tools: list[dict[str, Any]]):
    async def word_bot(client: Any, task: Any) -> None:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Request: {task.prompt}"},
        ]
        while not task.done:
            reply = await client.chat.completions.create(model=task.model, messages=messages, tools=tools)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            messages += await task.step(message)

    return word_bot


word_bot = agent_with([SUBMIT])
own_tools_bot = agent_with([ANSWER])

agentrl.register(
    "test/PickOwnAgent-v0", "agentrl.gateway:HarnessEnv", env="test/Pick-v0", agent="tests.own_agent:word_bot"
)
agentrl.register(
    "test/PickOwnTools-v0",
    "agentrl.gateway:HarnessEnv",
    env="test/Pick-v0",
    agent="tests.own_agent:own_tools_bot",
)
