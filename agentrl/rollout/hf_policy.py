"""`HFPolicy`: token-by-token sampling with a transformers model, the numerical reference the vLLM engine
is checked against (log-probs of the distribution sampled from, as vLLM's `processed_logprobs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.core.errors import UserError, did_you_mean
from agentrl.rollout.adapters import AdapterSource, adapter_dir
from agentrl.rollout.sampling import Generation, SamplingConfig, StopReason
from agentrl.rollout.weight_sync import WeightsLike, named_tensors

if TYPE_CHECKING:
    import torch


def _load_hf(model: Any, dtype: str = "float32", device: str | None = None) -> Any:
    """A transformers model in eval mode: loaded from a directory (onto `device`, by default CUDA when
    there is one), or the given module (moved to `device` only when one is named)."""
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype))
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device is not None:
        model = model.to(device)
    model.eval()
    return model


def _device_of(model: Any) -> Any:
    return next(model.parameters()).device


def _processed_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the sampling distribution, as vLLM's `processed_logprobs`: [..., V] -> [..., V]."""
    import torch

    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    if top_p < 1.0:
        probs = torch.softmax(logits, dim=-1)  # [..., V]
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [..., V]
        # Drop a token when the mass strictly before it already reaches top_p (the first token always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p  # [..., V]
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # [..., V]
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)  # [..., V]


class HFPolicy:
    """Token-by-token sampling with a transformers model (KV cache, no batching): the reference policy.

    LoRA adapters load through peft (`load_adapter`, `add_adapter`, `SamplingConfig.adapter`), with the
    meaning `VLLMPolicy` gives them; requests run one at a time, so a push waits for the request in flight.
    """

    def __init__(self, model: Any, dtype: str = "float32", device: str | None = None, *, version: int = 0):
        self.model = _load_hf(model, dtype, device)
        self._version = version
        self._lock = threading.Lock()
        # The PeftModel around `self.model` (its layers changed in place) once an adapter has loaded.
        self._peft: Any = None
        self._current: str | None = None  # peft's name of the pushed adapter
        self._named: dict[str, str] = {}  # add_adapter's name -> peft's name
        self._adapters = itertools.count(1)

    @property
    def version(self) -> int:
        return self._version

    def generate_sync(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        import torch

        if not prompt_ids:
            raise ValueError("generate needs at least one prompt token id")
        if sampling.structural_tag is not None:
            raise ValueError(
                "HFPolicy samples without constraints; SamplingConfig.structural_tag needs VLLMPolicy"
            )
        gen = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        stop = set(sampling.stop_token_ids)
        eos = self.model.config.eos_token_id
        if not sampling.ignore_eos:
            stop |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        with self._lock, torch.no_grad(), self._adapter_selected(sampling.adapter):
            version = self._version
            device = _device_of(self.model)
            ids = torch.tensor([prompt_ids], device=device)  # [1, P]
            out = self.model(ids, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]  # logits: [V]
            tokens: list[int] = []
            logprobs: list[float] = []
            reason: StopReason = "length"
            for _ in range(sampling.max_tokens):
                # The distribution comes back to the CPU: the seeded generator is a CPU one, so a seed
                # draws the same tokens on any device.
                logp = _processed_logprobs(logits, sampling.temperature, sampling.top_p).cpu()  # [V]
                if sampling.temperature == 0:
                    tok = int(logp.argmax())
                else:
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                tokens.append(tok)
                logprobs.append(float(logp[tok]))
                if tok in stop:
                    reason = "stop"
                    break
                out = self.model(torch.tensor([[tok]], device=device), past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[0, -1]
        return Generation(tokens, logprobs, reason, version, self._version)

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        return await asyncio.to_thread(self.generate_sync, prompt_ids, sampling)

    def load_adapter(self, adapter: AdapterSource, *, version: int | None = None) -> int:
        """Push a LoRA adapter (bytes or a directory, as `VLLMPolicy.load_adapter`): later requests carry it.
        Returns the new version (`version`, else one more than before)."""
        with self._lock:
            name = self._load(adapter)
            old, self._current = self._current, name
            self._drop(old, name)
            self._version = self._version + 1 if version is None else version
            return self._version

    def add_adapter(self, name: str, adapter: AdapterSource) -> None:
        """A named LoRA adapter, which a request selects with `SamplingConfig.adapter`."""
        if not name:
            raise UserError(
                "an adapter needs a non-empty name (SamplingConfig.adapter selects it by that name)"
            )
        with self._lock:
            peft_name = self._load(adapter)
            old, self._named[name] = self._named.get(name), peft_name
            self._drop(old, peft_name)

    def _load(self, adapter: AdapterSource) -> str:
        """The adapter loaded into the model under a fresh peft name (under `_lock`)."""
        from peft import PeftModel

        name = f"adapter-{next(self._adapters)}"
        with tempfile.TemporaryDirectory(prefix="agentrl-adapter-") as scratch:
            path, _ = adapter_dir(adapter, scratch)
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self.model, str(path), adapter_name=name)
            else:
                self._peft.load_adapter(str(path), adapter_name=name)
        self.model.eval()
        return name

    def _drop(self, old: str | None, new: str) -> None:
        """Delete a replaced adapter from the model (under `_lock`); the new one active, as peft wants."""
        if old is not None:
            self._peft.set_adapter(new, inference_mode=True)
            self._peft.delete_adapter(old)

    @contextlib.contextmanager
    def _adapter_selected(self, name: str | None) -> Iterator[None]:
        """The model with the adapter a request selects active: `name`'s, else the pushed one, else none."""
        if name is not None:
            if name not in self._named:
                known = ", ".join(sorted(self._named)) or "none"
                raise UserError(
                    f"no LoRA adapter named {name!r} (added: {known}); add it with add_adapter first"
                    + did_you_mean(name, self._named)
                )
            self._peft.set_adapter(self._named[name], inference_mode=True)
            yield
        elif self._current is not None:
            self._peft.set_adapter(self._current, inference_mode=True)
            yield
        elif self._peft is not None:
            with self._peft.disable_adapter():  # named adapters only: the request samples the base model
                yield
        else:
            yield

    def update_weights(self, weights: WeightsLike, *, version: int | None = None) -> int:
        """Load new weights; returns the new version (`version`, else one more than before)."""
        state = dict(named_tensors(weights))
        with self._lock:
            _missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected:
                raise ValueError(f"update_weights got names the model does not have: {unexpected[:5]}")
            self._version = self._version + 1 if version is None else version
        return self._version
