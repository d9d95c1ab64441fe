"""An agent that runs as a process of its own and takes its episodes from a trainer's agent service.

    python -m tests.gateway.service_agent http://127.0.0.1:PORT IDLE_S

Per episode: one completion with the environment's tools (the blocking openai client), the reply stepped
in the environment, done. A task whose prompt holds "(1)" is ended with an error instead (the agent's
own failure, reported). It exits after IDLE_S seconds without an episode and prints what it played.
"""

from __future__ import annotations

import json
import sys

import openai

from agentrl.gateway.service import EpisodeClient


def main(url: str, idle_s: float) -> None:
    played = []
    service = EpisodeClient(url)
    for episode in service.episodes(idle_s=idle_s):
        if "(1)" in episode.prompt:
            played.append([episode.task["id"], episode.end(error="my service lost its database")])
            continue
        with openai.OpenAI(base_url=episode.base_url, api_key="unused", max_retries=0) as client:
            reply = client.chat.completions.create(
                model=episode.model, messages=episode.messages, tools=episode.tools
            )
        observation = episode.step(reply.choices[0].message)
        played.append([episode.task["id"], episode.end(), episode.done, observation[0]["content"]])
    service.close()
    print(json.dumps(played))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
