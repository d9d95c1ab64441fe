"""One request to a policy and what it sampled: `SamplingConfig` in, `Generation` out.

Every policy (`VLLMPolicy`, `HFPolicy`, `RayPolicy`) and every caller speaks these types; they live apart
from the engines so that a caller that only builds requests or reads generations imports no engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

StopReason = Literal["stop", "length"]
"""Why a generation stopped: `stop`, a stop token (or the model's EOS); `length`, `max_tokens` ran out."""


class SamplingConfig(BaseModel):
    """How one request is sampled."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 is greedy decoding.")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 keeps the whole vocabulary."
    )
    max_tokens: int = Field(
        256, ge=1, description="Most tokens this request may sample (its stop token included)."
    )
    seed: int | None = Field(
        None,
        description="Per-request sampling seed (reproducible samples); None draws from the engine's RNG.",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="Token ids that end the generation; the stop token is kept in the output (it was sampled).",
    )
    ignore_eos: bool = Field(
        False, description="Do not stop at the model's EOS (fixed-length generation, as benchmarks need)."
    )
    adapter: str | None = Field(
        None,
        description="Name of a LoRA adapter added with `add_adapter` to sample with; None: the adapter pushed "
        "last (`load_adapter`, or the one the engine started with), or the base model when there is none.",
    )
    structural_tag: str | None = Field(
        None,
        description="Constrain the sample to this structure (xgrammar's structural tag, as JSON; vLLM's "
        "structured outputs): tokens outside it are masked before sampling, and the log-probs are those of "
        "the masked distribution. Only engines whose `supports_constraints` is true take it.",
    )


@dataclass(frozen=True)
class Generation:
    """What the policy sampled for one request."""

    token_ids: list[int]
    """Sampled ids, in order; a stop token, if one ended the generation, is the last id."""
    logprobs: list[float]
    """Log-probability of each sampled id under the sampling distribution (see the module docstring)."""
    stop_reason: StopReason
    """`stop`: a stop token (or the model's EOS) ended it; `length`: `max_tokens` ran out."""
    policy_version: int
    """Weights version when the request started; for a request that carried a pushed LoRA adapter, that
    adapter's version."""
    policy_version_end: int
    """Weights version when it finished (differs when weights were pushed mid-request); a request that
    carried a pushed adapter kept it to the end: its version again."""
    token_versions: tuple[int, ...] | None = None
    """The weights version each id was sampled with (a push mid-request switches it between two decode
    steps); None from a policy that does not say, which sampled every id with `policy_version` unless
    the two versions differ (see `versions`)."""

    def versions(self) -> list[int]:
        """The weights version of each sampled id: `token_versions`, or, from a policy that does not give
        them, `policy_version` for every id (the oldest it may have been: what staleness is measured by)."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.policy_version] * len(self.token_ids)
