"""FSDP2 plumbing shared by SFT and GRPO: process group, sharding, full state dicts, the Hugging Face export.

One code path for one process and many: the process group is always initialised (a one-rank
gloo group when not launched by `torchrun`), so a 1-process run and a 2-process run execute the
same sharded code and give the same numbers. NCCL on GPUs, gloo on CPUs.

Gradients: FSDP2 averages gradients over ranks (reduce-scatter with mean). A loss that is a
mean over the *global* batch must therefore be computed per rank as
`local_sum / global_count * world_size`; `global_token_scale` returns that factor.

Waiting on rank 0: only rank 0 generates rollouts, starts the engine and evaluates; the other ranks
wait meanwhile. A collective would time them out after the group's timeout (NCCL's watchdog kills
the process), however healthy rank 0 is, so they wait on the rendezvous store instead
(`wait_for_main`): no fuse, and the wait ends with an error as soon as the store goes away (rank 0's
launcher died). The group's timeout (`collective_timeout_s`) then bounds only the collectives of
the update itself, where every rank computes.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int  # ranks of all nodes
    local_rank: int  # rank on this node: the visible GPU this rank computes on
    device: torch.device
    backend: str
    local_world_size: int = 1  # ranks on this node (torchrun's --nproc-per-node): GPUs are counted per node
    node_rank: int = 0  # this node among the job's nodes; node 0 holds rank 0, which holds the engine

    @property
    def is_main(self) -> bool:
        return self.rank == 0


DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0


def _free_port() -> int:
    """A port that was free a moment ago. Only for addresses handed to a process that binds it at once (a
    test's rendezvous endpoint); a rendezvous of ours binds port 0 and keeps the socket (`init_distributed`,
    the NCCL weight-transfer endpoint), so no other process can take the port in between."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> DistInfo:
    """Join the `torchrun` process group, or make a one-rank group for a plain `python` run.

    `timeout_s` bounds each collective (the NCCL watchdog aborts a rank whose collective waits longer);
    waits on rank 0's solo work go through `wait_for_main`, which has no such bound.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            # The store binds port 0 and keeps its socket: the port is ours from the start, where picking a
            # free one and binding it again later leaves a window for another process to take it.
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
            os.environ.update(
                RANK="0",
                WORLD_SIZE="1",
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port),
            )
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    # torchrun numbers nodes in GROUP_RANK; ranks are contiguous per node, so the division agrees with it.
    node_rank = int(os.environ.get("GROUP_RANK", dist.get_rank() // max(local_world_size, 1)))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            from agentrl.core.errors import check_nproc

            # A torchrun started by hand with more processes than GPUs: say so, not "invalid device ordinal".
            check_nproc(local_world_size, torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistInfo(
        dist.get_rank(),
        dist.get_world_size(),
        local_rank,
        device,
        dist.get_backend(),
        local_world_size=local_world_size,
        node_rank=node_rank,
    )


def wait_for_main(tag: str, poll_s: float = 0.5) -> None:
    """Every rank, after rank 0's solo work (rollouts, the engine's start-up, evaluation) and before the
    collective that hands its result over: rank 0 marks `tag` done on the rendezvous store and goes on;
    the others wait for the mark, for as long as it takes. `tag` must be unique within the run.

    Polling the store, not blocking in a collective: no timeout can fire while rank 0 is merely busy, and
    the store's own failure (the launcher holding it exited) ends the wait with an error.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"agentrl/main-done/{tag}"
    if dist.get_rank() == 0:
        store.set(key, "1")
        return
    delay = 0.01
    while True:
        try:
            if store.check([key]):
                return
        except Exception as exc:
            raise RuntimeError(
                f"lost the rendezvous store while waiting for rank 0 ({tag}): rank 0 or its launcher stopped; "
                "its own error says why"
            ) from exc
        time.sleep(delay)
        delay = min(delay * 2, poll_s)


def run_ranks(
    module: str,
    payload: str,
    nproc: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
) -> None:
    """Run `python -m module payload` as `nproc` ranks under torchrun; blocks.

    One node (`nnodes=1`): a standalone rendezvous. Several: this machine is node `node_rank` of
    `nnodes`, every node started with the same `rdzv_endpoint` (HOST:PORT of node 0, reachable
    from all); the static rendezvous gives node 0 the global rank 0, which generates the rollouts.

    torchrun runs in its own session, so Ctrl-C in the terminal reaches only this process, which
    forwards it to the ranks (torchrun itself would kill them before they could save); a third
    Ctrl-C kills them. What rank 0 reports through `run_rank` comes back as the same exception: a
    `UserError` (one line) or a `KeyboardInterrupt` after an interrupted run saved its state.
    """
    import signal
    import subprocess
    import sys
    import tempfile

    from agentrl.core.errors import UserError

    rendezvous = _rendezvous_args(nnodes, node_rank, rdzv_endpoint)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        payload,
    ]
    with tempfile.TemporaryDirectory(prefix="agentrl-ranks-") as tmp:
        status_file = Path(tmp, "status.json")
        # OMP_NUM_THREADS: what torchrun would set, without its banner saying so.
        env = {
            "OMP_NUM_THREADS": "1",
            **os.environ,
            "AGENTRL_RANK_STATUS": str(status_file),
            "AGENTRL_RANK_PIDS": tmp,
        }
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        interrupts = 0
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                interrupts += 1
                if interrupts >= 3:
                    os.killpg(proc.pid, signal.SIGKILL)
                    continue
                for pid_file in Path(tmp).glob("rank-*.pid"):
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid_file.read_text()), signal.SIGINT)
        status = json.loads(status_file.read_text()) if status_file.exists() else None
        if status is not None and status.get("exit") == 130:
            raise KeyboardInterrupt
        if status is not None and status.get("exit") == 2:
            raise UserError(status.get("error", "a rank stopped on bad input"))
        if interrupts:
            raise KeyboardInterrupt
        if code != 0:
            raise subprocess.CalledProcessError(code, cmd[:6])


def _rendezvous_args(nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> list[str]:
    """torchrun's rendezvous options: standalone on one node, static across several (a UserError for an
    endpoint or node rank that cannot work)."""
    from agentrl.core.errors import UserError

    if nnodes > 1:
        if not rdzv_endpoint or ":" not in rdzv_endpoint:
            raise UserError(
                f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address, the same on every node), "
                f"got {rdzv_endpoint!r}"
            )
        if not 0 <= node_rank < nnodes:
            raise UserError(f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}")
        # Static: node ranks are the ones given (node 0 holds global rank 0), no rendezvous server.
        return [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--master-addr={rdzv_endpoint.rsplit(':', 1)[0]}",
            f"--master-port={rdzv_endpoint.rsplit(':', 1)[1]}",
        ]
    return ["--standalone"]


def run_here_or_as_ranks(run: Callable[[], Path], module: str, payload: str, nproc: int) -> Path | None:
    """A recipe's launch: `run()` in this process when `nproc` is 1 (its process group torn down
    after, whatever happens), else `python -m module payload` as `nproc` ranks (`run_ranks`), and
    None, since the ranks' result stays in their processes."""
    if nproc == 1:
        try:
            return run()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    run_ranks(module, payload, nproc)
    return None


def run_rank(main: Any) -> int:
    """The body of a rank launched by `run_ranks`: run `main()` and return the process exit status.

    Rank 0's bad input (`UserError`, printed as one `error:` line) and Ctrl-C (`KeyboardInterrupt`,
    after the run saved its state) go to the launcher through a status file, with exit 0 when every
    rank left together, so torchrun does not add its failure report; anything else is a bug and
    keeps its traceback.
    """
    import sys

    from agentrl.core.errors import UserError, one_line

    status_path = os.environ.get("AGENTRL_RANK_STATUS")
    rank = int(os.environ.get("RANK", "0"))
    status: dict[str, Any] | None = None
    collective = True
    try:
        main()
    except KeyboardInterrupt:
        status = {"exit": 130}
    except UserError as exc:
        status = {"exit": 2, "error": one_line(exc.args[0] if exc.args else str(exc))}
        collective = bool(getattr(exc, "collective", False))
        if not status_path and rank == 0:
            print(f"error: {status['error']}", file=sys.stderr)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if status is None:
        return 0
    if status_path and rank == 0:
        Path(status_path).write_text(json.dumps(status))
    if not status_path:
        return int(status["exit"])
    # Every rank raised together (an interrupt, a stop decided on rank 0): leave quietly. A user error
    # on rank 0 alone must fail the rank, or torchrun would wait on the others forever.
    return 0 if collective or status["exit"] == 130 else 1


def shard_model(
    model: nn.Module,
    *,
    activation_checkpointing: bool = False,
    bf16: bool | None = None,
    compiled: bool = False,
) -> nn.Module:
    """`fully_shard` every decoder layer, then the root (embeddings, final norm, tied head).

    bf16 defaults to on for CUDA (params and compute in bf16, gradient reduction in fp32) and
    off on CPU, where fp32 is both faster and what the numerical checks use. `compiled`: each
    decoder layer's forward through torch.compile (`agentrl.train.compiled`).
    """
    if compiled:
        from agentrl.train.compiled import compile_layers

        compile_layers(model, _decoder_layers(model))
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if bf16 is None:
        bf16 = torch.cuda.is_available()
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    layers = _decoder_layers(model)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks of a HF causal LM (Qwen2/Llama: model.model.layers)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}; expected model.model.layers")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict, on every rank (a collective: call it on all ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def global_token_scale(local_count: float, device: torch.device) -> tuple[float, float]:
    """(scale, global_count) so that `local_sum * scale` is this rank's share of a global token mean."""
    t = torch.tensor([float(local_count)], device=device)
    dist.all_reduce(t)
    global_count = float(t.item())
    if global_count == 0:
        return 0.0, 0.0
    return dist.get_world_size() / global_count, global_count


def all_reduce_mean(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Mean of scalar metrics over ranks."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], device=device, dtype=torch.float64)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return {k: float(v) for k, v in zip(keys, t.tolist(), strict=True)}


HF_CHECKPOINT_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",
    }
)


def export_hf(model_sd: dict[str, torch.Tensor], base_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a transformers checkpoint directory: `base_dir`'s config and tokenizer, these weights."""
    import shutil

    from safetensors.torch import save_file

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Only what makes a transformers checkpoint: a base directory may also hold a run's logs and
    # records (metrics.jsonl, sft_config.json, build records) that must not leak into this one.
    for f in base_dir.iterdir():
        if f.is_file() and (f.name in HF_CHECKPOINT_FILES or f.name.startswith("tokenizer")):
            shutil.copy2(f, out_dir / f.name)
    # Tied weights share storage; safetensors refuses shared tensors, and HF re-ties on load.
    sd = {k: v.detach().contiguous().clone() for k, v in model_sd.items()}
    config = json.loads((base_dir / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    save_file(sd, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir
