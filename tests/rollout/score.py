"""The reference log-probs the rollout's are checked against: one transformers forward pass over ids,
what a trainer would compute."""

from __future__ import annotations

from typing import Any

from agentrl.rollout.hf_policy import _device_of, _load_hf, _processed_logprobs


def score_logprobs(model: Any, token_ids: list[int], temperature: float = 1.0) -> list[float]:
    """log p(token_ids[i] | token_ids[:i]) from one transformers forward pass; index 0 is 0.0.

    `model` is a model directory or a loaded `PreTrainedModel`. `temperature` scales the logits as the
    sampler did (use 1.0 for greedy samples: vLLM reports raw log-probs at temperature 0).
    """
    import torch

    model = _load_hf(model)
    ids = torch.tensor([token_ids], device=_device_of(model))  # [1, T]
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, :-1]  # [T - 1, V]
    logp = _processed_logprobs(logits, temperature if temperature > 0 else 1.0, 1.0)  # [T - 1, V]
    chosen = logp.gather(1, ids[0, 1:, None])[:, 0]  # [T - 1]
    return [0.0, *chosen.tolist()]
