"""How weights move from the trainer into the rollout engine: both ends, and the sleep and wake around them.

    sync = WeightSync(placement, policy_on_rank_0_or_None, model, info, active=True)
    sync.before_update()        # a colocated engine sleeps: its weights and KV cache leave the GPU
    grpo_step(...)
    version = sync.after_update()   # wake weights -> push the new ones -> give memory back -> wake the KV cache

`WeightSync` is called on every trainer rank (pushing is a collective: each rank's shard is gathered);
only rank 0 holds the engine. The push depends on the `agentrl.rollout.placement`:

- `rpc` (CPU): the full state dict is gathered to the CPU and handed to `VLLMPolicy.update_weights`,
  which streams it to the engine's workers in buckets of `chunk_bytes` (`buckets`; serialized when the
  engine is another process), where `VLLMWeightSyncExtension` loads them.
- `ipc` (colocated GPUs) and `nccl` (dedicated GPUs): vLLM's weight-transfer engines
  (`vllm.distributed.weight_transfer`), reached through `EngineWeightSyncClient`. The trainer's
  parameters are gathered one at a time on their GPU (each shard cast to bf16 first, so the gather
  moves and holds bf16, not fp32), packed into chunks of `chunk_bytes` and handed over as CUDA IPC
  handles (the engine reads them in place) or broadcast over an NCCL group between trainer rank 0 and
  the engine's workers: no CPU round trip, no serialization.

Memory beside a colocated engine: only ranks whose GPU an engine worker uses stage the IPC chunks
(`StagedIPCSender`; vLLM's own sender stages on every rank), and after the push those ranks hand the
staging buffer and the gather temporaries back to the driver before the KV cache wakes: left in
PyTorch's cache they would sit beside the engine's cache for the whole generation.

The order around an update matters with sleep mode level 2: weights are woken (allocated) before
they are loaded, and the KV cache only after, so the push never competes with the cache for memory.
Every push increments the policy's `version` once.

The engine-core process imports this module by name (`VLLMWeightSyncExtension`): it imports nothing
of agentrl's above the rollout stage.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from agentrl.rollout.placement import Placement

if TYPE_CHECKING:  # torch is imported where it is used: `agentrl.rollout.vllm_engine` imports this module cheaply
    import torch
    from torch import nn

DEFAULT_WEIGHT_CHUNK_BYTES = 512 << 20
"""One chunk of a weight push: a bucket of `update_weights`, the staging buffer of the GPU transfers."""
DEFAULT_SLEEP_WAIT_S = 300.0
"""How long `VLLMPolicy.sleep` waits for requests still running before it gives up."""

WeightsLike = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]
"""New weights: a state dict, or (name, tensor) pairs, under the checkpoint's (Hugging Face) names."""


def named_tensors(weights: WeightsLike) -> Iterable[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `weights`."""
    return weights.items() if isinstance(weights, Mapping) else weights


# ---------------------------------------------------------------------------------------------------------
# The engine's side: what its workers run, and the calls that reach them


class VLLMWeightSyncExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): receives new weights from the trainer.

    An update is begin -> load chunk(s) -> finish, each a `collective_rpc`, so a large model can be
    streamed in buckets. It uses vLLM's layer-wise reload (the machinery behind `reload_weights`),
    which re-runs each layer's post-load processing: on CPU the linear layers keep their weights
    packed for oneDNN/SGL kernels, so copying into the parameters alone would change nothing.
    The engine-core process imports this class by name (see the module doc).
    """

    def agentrl_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        _ExpectedReloadWarnings.install(model)
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(model)
        self._agentrl_loaded: set[str] = set()

    def agentrl_load_weights(self, named_tensors: list[tuple[str, Any]] | bytes) -> int:
        from vllm.config import set_current_vllm_config

        if not hasattr(self, "_agentrl_loaded"):
            raise RuntimeError("agentrl_load_weights called without agentrl_begin_weight_update")
        if isinstance(named_tensors, (bytes, bytearray)):  # a bucket sent across processes
            import safetensors.torch

            named_tensors = list(safetensors.torch.load(bytes(named_tensors)).items())
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            loaded = model.load_weights((str(name), tensor) for name, tensor in named_tensors)
        self._agentrl_loaded |= set(loaded or ())
        return len(named_tensors)

    def agentrl_finish_weight_update(self) -> list[str]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(model, self.model_config)  # type: ignore[attr-defined]
            # A tied output head (lm_head sharing embed_tokens.weight) receives no weights of its own,
            # so the reload never re-processes it; on CPU its packed GEMM copy would keep the old
            # embedding. Re-run post-load processing of every module whose weight is shared.
            owners: dict[int, list[Any]] = {}
            for module in model.modules():
                weight = module.__dict__.get("_parameters", {}).get("weight")
                if weight is not None and weight.numel() > 0:
                    owners.setdefault(id(weight), []).append(module)
            for modules in owners.values():
                if len(modules) > 1:
                    for module in modules:
                        method = getattr(module, "quant_method", None)
                        if method is not None and hasattr(method, "process_weights_after_loading"):
                            method.process_weights_after_loading(module)
        self.model_runner.reset_lora_state()  # type: ignore[attr-defined]
        loaded = sorted(getattr(self, "_agentrl_loaded", ()))
        self._agentrl_loaded = set()
        return loaded


class _ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" for layers that have nothing to load.

    vLLM 0.32's layer-wise reload (model_loader/reload/layerwise.py, `finalize_layerwise_processing`)
    counts every tensor of a layer as loadable, buffers included. A layer whose only tensors are
    non-persistent buffers (RotaryEmbedding's `cos_sin_cache`, computed at construction and in no
    checkpoint) receives nothing from a weight push, so the reload warns "Failed to load weights" and
    then puts the original buffer back, which is exactly right. The same holds for a tied output head
    (`ParallelLMHead` sharing `embed_tokens.weight`): checkpoints carry no weight of its own, and
    `agentrl_finish_weight_update` re-processes it from the shared one. On every push, for every
    such layer, it reads like a failed sync; a layer with parameters of its own that fails still warns.
    """

    def __init__(self, layer_classes: set[str]):
        super().__init__()
        self.layer_classes = layer_classes

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights"
            and isinstance(record.args, tuple)
            and record.args
            and record.args[0] in self.layer_classes
        )

    @classmethod
    def install(cls, model: Any) -> None:
        names = set()
        seen: set[int] = set()  # parameters of modules met earlier (the checkpoint loads those)
        for module in model.modules():
            params = [p for p in module._parameters.values() if p is not None]
            buffers = {n for n, b in module._buffers.items() if b is not None}
            if not params and buffers and buffers <= set(module._non_persistent_buffers_set):
                names.add(type(module).__name__)
            elif params and all(id(p) in seen for p in params):
                names.add(type(module).__name__)  # a tied head: every parameter is an earlier layer's
            seen.update(id(p) for p in params)
        logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        for existing in logger.filters:
            if isinstance(existing, cls):
                existing.layer_classes |= names
                return
        logger.addFilter(cls(names))


def buckets(named: Iterable[tuple[str, Any]], limit: int, serialize: bool) -> list[Any]:
    """Group tensors into buckets of at most `limit` bytes (one tensor may exceed it alone), each loaded
    by one `agentrl_load_weights` call.

    With `serialize`, each bucket becomes safetensors bytes: the engine's RPC to a worker process
    pickles plain data reliably, while nested (name, tensor) pairs do not survive it (vLLM 0.32 turns
    them into lists). In process, the tensors are handed over as they are (no copy).
    """
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, tensor in named:
        t = tensor.detach()
        if serialize:
            # Own host memory per tensor: safetensors refuses tensors that share storage (tied weights).
            t = t.to("cpu", copy=True).contiguous()
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nbytes
    if not out[-1]:
        raise ValueError("update_weights got no tensors; pass a state dict or an iterable of (name, tensor)")
    if serialize:
        import safetensors.torch

        return [safetensors.torch.save(dict(bucket)) for bucket in out]
    return out


class _Engine(Protocol):
    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]: ...


class EngineWeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` protocol over a `VLLMPolicy`'s engine: the four phases of a weight
    transfer as blocking `collective_rpc`s to its workers (what `AsyncLLM.init_weight_transfer_engine`
    and friends send). CUDA IPC handles are pickled into `ipc_handles_pickled`, the form vLLM's
    workers accept from outside their process (as its HTTP client does)."""

    def __init__(self, policy: _Engine):
        self.policy = policy

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.policy.rpc("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.policy.rpc("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        payload = (
            [_pickled_handles(u) for u in update_info]
            if isinstance(update_info, list)
            else _pickled_handles(update_info)
        )
        self.policy.rpc("update_weights", {"update_info": payload})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.policy.rpc("finish_weight_update")


def _pickled_handles(update_info: dict[str, Any]) -> dict[str, Any]:
    if update_info.get("ipc_handles") is None:
        return update_info
    import base64
    import pickle

    out = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode("ascii")
    return out


# ---------------------------------------------------------------------------------------------------------
# The trainer's side: its parameters, gathered and sent


# Module wrappers whose names must not reach the engine (activation checkpointing adds the first).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def checkpoint_name(name: str) -> str:
    """A trainer parameter's name as the checkpoint (and vLLM's `load_weights`) knows it."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def named_trainer_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, parameter) of every parameter, shared ones (a tied head) once."""
    for name, param in model.named_parameters():
        yield checkpoint_name(name), param


def trainer_weight_source(model: nn.Module, dtype: torch.dtype | None = None) -> Any:
    """vLLM's `WeightSource` over the (FSDP-sharded) trainer: metadata without gathering, iteration that
    gathers one full parameter at a time on its device (a collective: every rank iterates) in `dtype`,
    the wire and engine dtype (None: bf16)."""
    import torch
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, materialize_full_tensor

    dtype = dtype or torch.bfloat16

    class TrainerWeights(WeightSource):
        def metadata(self) -> list[Any]:
            # A DTensor's shape is the global one: no gather needed here.
            return [ParamMeta(name, dtype, tuple(p.shape)) for name, p in named_trainer_parameters(model)]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, p in named_trainer_parameters(model):
                # Cast the shard, then gather: the all-gather moves bf16 and no full fp32 copy is made.
                yield name, materialize_full_tensor(p.detach().to(dtype))

    return TrainerWeights()


def tensor_bytes(meta: Any) -> int:
    """Bytes of the tensor a `ParamMeta` announces."""
    return math.prod(meta.shape) * meta.dtype.itemsize


def staging_bytes(metadata: list[Any], chunk_bytes: int) -> int:
    """The staging buffer for `chunk_bytes` chunks: at least the largest tensor, which travels whole (vLLM's
    producer refuses a larger one; Qwen2.5-7B's embedding alone is 1.09 GB, over its 1 GiB default)."""
    return max(chunk_bytes, *(tensor_bytes(m) for m in metadata)) if metadata else chunk_bytes


def chunk_plan(metadata: list[Any], buffer_bytes: int) -> list[list[str]]:
    """The names in each chunk of a packed push, cut as vLLM's `packed_ipc_producer` cuts them: a tensor
    that would overflow a non-empty chunk starts the next one."""
    chunks: list[list[str]] = []
    names: list[str] = []
    total = 0
    for meta in metadata:
        size = tensor_bytes(meta)
        if size > buffer_bytes:
            raise ValueError(
                f"{meta.name} takes {size} bytes, more than the {buffer_bytes}-byte staging buffer"
            )
        if total and total + size > buffer_bytes:
            chunks.append(names)
            names, total = [], 0
        names.append(meta.name)
        total += size
    if names:
        chunks.append(names)
    return chunks


def _unstaged_chunks(iterator: Iterator[tuple[str, torch.Tensor]], buffer_bytes: int) -> Iterator[Any]:
    """`packed_ipc_producer`'s loop without the buffer: consumes the source item for item (its gathers are
    collectives) and yields the same chunks at the same points, with no handle. The producer takes the
    first tensor of the next chunk before it yields the current one, and so does this: the collectives
    of the ranks that stage and of those that do not line up one for one."""
    from vllm.distributed.weight_transfer.packed_tensor import PackedIpcChunk

    names: list[str] = []
    shapes: list[list[int]] = []
    dtypes: list[torch.dtype] = []
    sizes: list[int] = []
    total = 0

    def chunk() -> Any:
        return PackedIpcChunk(names, shapes, [str(d).split(".")[-1] for d in dtypes], sizes, {})

    for name, tensor in iterator:
        size = tensor.numel() * tensor.element_size()
        if total and total + size > buffer_bytes:
            yield chunk()
            names, shapes, dtypes, sizes, total = [], [], [], [], 0
        names.append(name)
        shapes.append(list(tensor.shape))
        dtypes.append(tensor.dtype)
        sizes.append(size)
        total += size
        del tensor  # nothing stages here: the gathered copy goes at once
    if total:
        yield chunk()


def _gpu_uuid() -> str:
    import torch

    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def _current_gpu() -> int:
    import torch

    return torch.cuda.current_device()


class StagedIPCSender:
    """The trainer side of vLLM's packed CUDA IPC weight transfer (`vllm.distributed.weight_transfer.ipc_engine`,
    whose worker side receives it), staging only on the ranks whose GPU an engine worker reads.

    vLLM's `IPCTrainerWeightTransferEngine` allocates the staging buffer on every trainer rank; colocated
    with `--nproc` > 1 and a one-GPU engine, all but GPU 0's are never read. Here a rank that `stages` runs
    vLLM's own `packed_ipc_producer`; one that does not iterates the same source (its FSDP gathers are
    collectives every rank must join) in the same chunks and contributes no handle. The handles of a chunk
    are all-gathered and merged (keyed by GPU UUID: each engine worker opens its own GPU's), rank 0 ships
    them, and a barrier keeps every stager from overwriting its buffer before the engine has read it.
    """

    def __init__(
        self,
        *,
        client: Any,
        source: Any,
        rank: int,
        stages: bool,
        chunk_bytes: int = DEFAULT_WEIGHT_CHUNK_BYTES,
    ):
        self.client = client
        self.source = source
        self.is_sender = rank == 0
        self.stages = stages
        self.chunk_bytes = chunk_bytes
        self.chunks_sent = 0  # chunks of the last push
        if self.is_sender:
            # The worker decodes as the trainer encodes: packed, told once at the handshake.
            client.init_weight_transfer_engine({"packed": True})

    def send_weights(self) -> None:
        """Every rank: one push, start -> a chunk at a time -> finish."""
        import torch
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
        from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_producer

        metadata = self.source.metadata()
        buffer_bytes = staging_bytes(metadata, self.chunk_bytes)
        plan = chunk_plan(metadata, buffer_bytes)
        if self.is_sender:
            self.client.start_weight_update()
        if self.stages:
            chunks = packed_ipc_producer(
                iter(self.source),
                _gpu_uuid(),
                post_iter_func=lambda item: item[1],
                buffer_size_bytes=buffer_bytes,
            )
        else:
            chunks = _unstaged_chunks(iter(self.source), buffer_bytes)
        sent = 0
        try:
            for chunk in chunks:
                if sent >= len(plan) or chunk.names != plan[sent]:
                    raise RuntimeError(
                        f"chunk {sent} of the weight push holds {chunk.names[:3]}..., the plan "
                        f"{plan[sent][:3] if sent < len(plan) else []}...: the ranks would disagree on the chunks"
                    )
                handles = self._merged(chunk.ipc_handle)
                if self.is_sender:
                    update = IPCWeightTransferUpdateInfo(
                        names=chunk.names,
                        dtype_names=chunk.dtype_names,
                        shapes=chunk.shapes,
                        ipc_handles=handles,
                        tensor_sizes=chunk.tensor_sizes,
                    )
                    self.client.update_weights(asdict(update))
                # The producer reuses one buffer: no stager may write the next chunk before the engine read this one.
                _barrier()
                sent += 1
        finally:
            chunks.close()  # the generator holds the staging buffer; closing it lets the buffer go
        if sent != len(plan):
            raise RuntimeError(f"the weight push sent {sent} of its {len(plan)} chunks")
        self.chunks_sent = sent
        if self.is_sender:
            self.client.finish_weight_update()  # the engine releases its mapping of the buffer
        _barrier()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # the buffer was shared: freed only once every importer let go

    @staticmethod
    def _merged(handle: dict[str, Any]) -> dict[str, Any]:
        """This chunk's handles of every rank that staged it, one per GPU UUID."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return dict(handle)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, handle)
        merged: dict[str, Any] = {}
        for part in gathered:
            merged.update(part or {})
        return merged

    def shutdown(self) -> None:
        pass


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def nccl_sender(
    *, client: Any, source: Any, world_size: int, chunk_bytes: int = DEFAULT_WEIGHT_CHUNK_BYTES
) -> Any:
    """vLLM's NCCL trainer engine for trainer rank 0 (the sender), its rendezvous on a port held from the start.

    vLLM's `NCCLTrainerWeightTransferEngine.trainer_init` takes a port number and binds it only when it opens
    its endpoint: a port found free earlier and released meanwhile can be taken by another process. Here the
    listening socket is bound first (port 0: the system picks) and handed to the rendezvous store, which
    listens on it, so the port is never free. The rest is `trainer_init`, step for step."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer.nccl_common import worker_init_payload
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerWeightTransferEngine,
        NCCLWeightTransferInitInfo,
    )
    from vllm.utils.nccl import unpinned_nccl_env

    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind(("127.0.0.1", 0))  # the engine's workers run on this node, beside rank 0
    listen.listen()
    port = listen.getsockname()[1]
    engine = NCCLTrainerWeightTransferEngine(
        client=client, source=source, is_sender=True, packed=True, packed_buffer_size_bytes=chunk_bytes
    )
    worker = NCCLWeightTransferInitInfo(
        master_address="127.0.0.1",
        master_port=port,
        rank_offset=1,  # the workers follow the one trainer rank
        world_size=world_size,
        packed=True,
        packed_buffer_size_bytes=chunk_bytes,
        packed_num_buffers=engine.packed_num_buffers,
    )
    # The workers block in init_weight_transfer_engine until the rendezvous completes: both sides at once.
    with ThreadPoolExecutor(max_workers=1) as exe:
        future = exe.submit(client.init_weight_transfer_engine, worker_init_payload(worker))
        try:
            group = StatelessProcessGroup.create(
                host="127.0.0.1", port=port, rank=0, world_size=world_size, listen_socket=listen
            )
        except BaseException:
            listen.close()
            raise
        with unpinned_nccl_env():
            engine.model_update_group = PyNcclCommunicator(group, device=_current_gpu())
        future.result()  # an error on the engine's side surfaces here
    return engine


class RankInfo(Protocol):
    """Where a trainer rank is (`agentrl.train.distributed.DistInfo` is one)."""

    rank: int
    local_rank: int
    node_rank: int

    @property
    def is_main(self) -> bool: ...


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on the CPU, on every rank (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class WeightSync:
    """Sleep/wake of the engine around each update, and the push of the new weights (see the module doc)."""

    def __init__(
        self,
        placement: Placement,
        policy: Any | None,
        model: nn.Module,
        info: RankInfo,
        *,
        active: bool = True,
        chunk_bytes: int = DEFAULT_WEIGHT_CHUNK_BYTES,
        sleep_wait_s: float = DEFAULT_SLEEP_WAIT_S,
        adapter: Callable[[], Mapping[str, bytes] | None] | None = None,
        merged: Callable[[], dict[str, torch.Tensor]] | None = None,
    ):
        """`adapter`: a LoRA run that pushes its adapter only: a collective every rank calls, giving rank 0
        peft's two files (the engine serves them on its resident base weights). `merged`: a LoRA run that
        pushes full weights instead, base + adapter merged (a collective giving the full state dict under
        the checkpoint's names). Neither: the trainer's own weights, by `placement.transport`."""
        if info.is_main and active and policy is None:
            raise ValueError("WeightSync on rank 0 needs the policy it pushes to")
        self.placement = placement
        self.policy = policy if info.is_main else None
        self.model = model
        self.info = info
        self.active = active  # False when nothing generates (replayed trajectories): no push, no sleep
        self.chunk_bytes = chunk_bytes
        self.sleep_wait_s = sleep_wait_s
        # Whether an engine worker shares this rank's GPU: only such a rank stages IPC chunks and must give
        # its cached memory back before the engine takes it.
        self.beside_engine = placement.shares_engine_gpu(node_rank=info.node_rank, local_rank=info.local_rank)
        self.adapter = adapter
        self.merged = merged
        self._sender: Any = None
        self._asleep = False

    def before_update(self) -> None:
        """Rank 0: put a colocated engine to sleep so the update has its memory."""
        if self.active and self.placement.sleep and self.policy is not None and not self._asleep:
            # An adapter push leaves the base weights as they are: level 1 keeps them (offloaded to the
            # host, back on waking) instead of dropping them for a push that will not come.
            self.policy.sleep(level=1 if self.adapter is not None else 2, wait_s=self.sleep_wait_s)
            self._asleep = True

    def after_update(self) -> int | None:
        """Every rank: wake the engine's weights, push the new ones, give the push's memory back, wake its KV
        cache. Returns the policy version on rank 0 (None elsewhere, or when inactive)."""
        if not self.active:
            return None
        # The engine maps its memory with its own allocator: blocks PyTorch freed but still caches
        # (this update's activations) must go back to the driver before the engine wakes.
        self._release_cached_memory()
        if self._asleep and self.policy is not None:
            self.policy.wake_up(["weights"])
        self.push()
        # The staging buffer and the gather temporaries, likewise, before the KV cache takes its share.
        self._release_cached_memory()
        if self.placement.colocated:
            _barrier()  # every GPU the engine uses is released before rank 0 wakes its cache
        if self._asleep and self.policy is not None:
            self.policy.wake_up(["kv_cache"])
            self._asleep = False
        return None if self.policy is None else int(self.policy.version)

    def _release_cached_memory(self) -> None:
        import torch

        if self.beside_engine and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def push(self) -> None:
        """Every rank: the trainer's weights (or its LoRA adapter) into the engine (one version)."""
        if self.adapter is not None:
            files = self.adapter()  # collective: every rank gathers its adapter shards
            if self.policy is not None:
                assert files is not None
                self.policy.load_adapter(files)
            return
        if self.merged is not None:
            sd = self.merged()  # collective
            if self.policy is not None:
                self.policy.update_weights(sd)
            return
        if self.placement.transport == "rpc":
            sd = full_state_dict(self.model)  # collective: every rank gathers
            if self.policy is not None:
                self.policy.update_weights(sd)
            return
        sender = self._ensure_sender()
        if self.policy is None:
            sender.send_weights()  # this rank's share of the gathers (and its IPC handles)
            return
        with self.policy.pushing_weights():
            sender.send_weights()

    def _ensure_sender(self) -> Any:
        if self._sender is not None:
            return self._sender
        try:
            import vllm.distributed.weight_transfer  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                f"the {self.placement.transport} weight transfer needs vLLM >= 0.32 "
                "(vllm.distributed.weight_transfer); pip install 'agentrl[gpu]'"
            ) from exc
        client = self.policy.weight_sync_client() if self.policy is not None else None
        source = trainer_weight_source(self.model)
        if self.placement.transport == "ipc":
            self._sender = StagedIPCSender(
                client=client,
                source=source,
                rank=self.info.rank,
                stages=self.beside_engine,
                chunk_bytes=self.chunk_bytes,
            )
        elif self.info.is_main:
            self._sender = nccl_sender(
                client=client,
                source=source,
                world_size=1 + len(self.placement.engine_gpus),  # trainer rank 0 + the engine's workers
                chunk_bytes=self.chunk_bytes,
            )
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

            # Not in the NCCL group: this rank only joins the gathers of each push.
            self._sender = NCCLTrainerWeightTransferEngine(
                client=client,
                source=source,
                is_sender=False,
                packed=True,
                packed_buffer_size_bytes=self.chunk_bytes,
            )
        return self._sender

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown()
            self._sender = None
