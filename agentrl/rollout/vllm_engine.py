"""`VLLMPolicy`: vLLM's v1 engine serving one model to many concurrent rollouts, in one of two modes
(`AsyncLLM` with the engine core in its own process, or `LLMEngine` stepped by a thread of this process),
with weight pushes, sleep and wake, and the CPU settings this machine needs. Its LoRA adapters are
`agentrl.rollout.vllm_adapters`'; the request types are `agentrl.rollout.sampling`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from agentrl.core.errors import UserError
from agentrl.rollout.adapters import adapter_rank, check_adapter_dir
from agentrl.rollout.placement import physical_devices
from agentrl.rollout.sampling import Generation, SamplingConfig
from agentrl.rollout.vllm_adapters import VLLMAdapters, engine_lora_rank
from agentrl.rollout.weight_sync import (
    DEFAULT_SLEEP_WAIT_S,
    DEFAULT_WEIGHT_CHUNK_BYTES,
    EngineWeightSyncClient,
    VLLMWeightSyncExtension,
    WeightsLike,
    buckets,
    named_tensors,
)

log = logging.getLogger(__name__)

# vLLM logs to stdout by default; our commands and benchmarks print JSON there. Its logs go to
# stderr unless the user chose otherwise (set before vLLM is imported: it reads this at import).
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


class EngineBusyError(RuntimeError):
    """The engine could not be put to sleep: requests were still running when the bounded wait ran out."""


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


def _max_lora_rank(lora_rank: int | None, adapter: str | os.PathLike[str] | None) -> int | None:
    """The engine's `max_lora_rank` for `lora_rank`, else for the rank of the adapter it starts with (None:
    no LoRA); a UserError, before the engine starts for nothing, when that adapter's rank is above it."""
    start_rank = adapter_rank(check_adapter_dir(adapter)) if adapter is not None else None
    lora_rank = start_rank if lora_rank is None else lora_rank
    max_rank = engine_lora_rank(lora_rank) if lora_rank is not None else None
    if start_rank is not None and max_rank is not None and start_rank > max_rank:
        raise UserError(
            f"the LoRA adapter at {adapter} has rank {start_rank}, above the engine's max_lora_rank "
            f"{max_rank}; start the engine with lora_rank >= {start_rank}"
        )
    return max_rank


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


class VLLMPolicy(VLLMAdapters):
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
        self._init_adapters(_max_lora_rank(lora_rank, adapter))
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
        self._start_thread(devices, weight_transfer)
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

    def _start_thread(self, devices: Sequence[int] | None, weight_transfer: str) -> None:
        """Start the engine on its own thread and wait until it runs; a RuntimeError saying what to check
        when it cannot start."""
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        if self.in_process:
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
        try:
            self._loop.run_forever()
        finally:
            self._drain_loop()

    def _drain_loop(self) -> None:
        """After `close` stopped the loop: cancel what still runs on it and let it finish, then close it, in
        this thread, the one whose tasks used the engine client's zmq sockets (libzmq sockets are not
        thread-safe: one closed or collected under another thread's waiter can abort the process)."""
        pending = [task for task in asyncio.all_tasks(self._loop) if not task.done()]
        for task in pending:
            task.cancel()
        with contextlib.suppress(Exception):
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

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
        try:
            self._shutdown_engine()
        finally:
            self._drop_scratch()

    def _shutdown_engine(self) -> None:
        """Stop the engine and the thread that drives it."""
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

            def stop() -> None:
                # On the loop's own thread: the client closes its sockets and cancels its tasks there
                # directly, instead of from this thread while the loop may still wait on them.
                try:
                    self._engine.shutdown()
                finally:
                    self._loop.stop()

            if self._thread.is_alive() and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(stop)
                self._thread.join(timeout=60)
            else:  # the loop's thread is gone: nothing waits on the sockets any more
                self._engine.shutdown()
            del self._engine  # AsyncLLM.__del__ shuts down again; let it run now, not at interpreter exit

    def __enter__(self) -> VLLMPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _deliver(loop: asyncio.AbstractEventLoop, setter: Any, fut: asyncio.Future[Any], value: Any) -> None:
    """Hand an engine result to the waiter's event loop; a closed loop means the waiter is gone."""
    with contextlib.suppress(RuntimeError):  # 'Event loop is closed': the caller stopped waiting (Ctrl-C)
        loop.call_soon_threadsafe(setter, fut, value)


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
