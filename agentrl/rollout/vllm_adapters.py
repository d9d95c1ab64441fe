"""The LoRA adapters a `VLLMPolicy` serves: the pushed one every new request carries, named ones a request
selects, and replaced ones that stay in the engine until the last request carrying them is done.

`VLLMAdapters` is the part of `VLLMPolicy` that keeps this record (`load_adapter`, `add_adapter`, ...); it is
a mixin because every change to the record is also an engine call (`add_lora`, `remove_lora`) made on the
engine's own thread, with the policy's locks and version counter.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import itertools
import logging
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.core.errors import UserError, did_you_mean
from agentrl.rollout.adapters import AdapterSource, adapter_dir, adapter_rank

log = logging.getLogger(__name__)


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


_SCRATCH_PREFIX = "agentrl-adapters-"
_OWNER = ".owner"


def claim_scratch(tmp: Path) -> tuple[Path, int]:
    """A fresh folder for pushed adapters under `tmp`, and the descriptor whose lock marks it as ours
    for as long as this process lives (the kernel drops the lock with the process, however it ends).

    Folders under `tmp` whose lock nobody holds any more are removed first: an engine killed from outside
    (the OOM killer, a crashed Ray actor) ran neither `close()` nor its exit hooks. A folder without a
    lock file is left alone (it may be a moment old: the file is locked before it takes its name)."""
    for old in tmp.glob(f"{_SCRATCH_PREFIX}*/{_OWNER}"):
        with contextlib.suppress(OSError), open(old, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live engine's
            shutil.rmtree(old.parent, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=_SCRATCH_PREFIX, dir=tmp))
    fd = os.open(path / f"{_OWNER}.new", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(path / f"{_OWNER}.new", path / _OWNER)
    return path, fd


def _release_scratch(path: Path, owner: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.close(owner)


class VLLMAdapters:
    """LoRA adapters of a `VLLMPolicy` (see `load_adapter`, `add_adapter`); the engine side is the policy's."""

    # Set by `VLLMPolicy.__init__` (the adapter records by `_init_adapters`).
    in_process: bool
    max_lora_rank: int | None
    _version: int
    _closed: bool
    _update_lock: threading.Lock
    _lora_lock: threading.Lock
    _lora_ids: itertools.count[int]
    _current: _Adapter | None
    _named: dict[str, _Adapter]
    _retired: set[_Adapter]
    _scratch: Path | None
    _scratch_cleanup: weakref.finalize | None
    _engine: Any
    _loop: asyncio.AbstractEventLoop
    _commands: Any

    def _init_adapters(self, max_lora_rank: int | None) -> None:
        """The adapter records of a new engine (`VLLMPolicy.__init__`), before it starts."""
        self.max_lora_rank = max_lora_rank
        """The largest adapter rank the engine serves (vLLM's `max_lora_rank`); None: started without LoRA."""
        # Guards the adapter records below; held briefly, never across an engine call.
        self._lora_lock = threading.Lock()
        self._lora_ids = itertools.count(1)
        self._current = None
        self._named = {}
        self._retired = set()  # replaced, still carried by requests in flight
        self._scratch = None  # temporary directories of pushed adapters (`_scratch_dir`)
        self._scratch_cleanup = None

    def _call_inproc(self, fn: Any) -> Any:
        """`fn(engine)` on the in-process engine's step thread, blocking (`VLLMPolicy` defines it)."""
        raise NotImplementedError

    def _call_async(self, coro: Any) -> Any:
        """`coro` on the `AsyncLLM`'s event loop, blocking (`VLLMPolicy` defines it)."""
        raise NotImplementedError

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
        path, temp_dir = adapter_dir(adapter, self._scratch_dir())
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

    def _scratch_dir(self) -> Path:
        """Our folder of pushed adapters: made at the first push, removed by `close()`, at interpreter exit
        when the process ends without closing the engine (a run stopped by an error on its way out), or by
        the next engine on this machine when the process was killed (`claim_scratch`)."""
        if self._scratch is None:
            self._scratch, owner = claim_scratch(Path(tempfile.gettempdir()))
            self._scratch_cleanup = weakref.finalize(self, _release_scratch, self._scratch, owner)
        return self._scratch

    def _drop_scratch(self) -> None:
        """Delete the folder of pushed adapters now (`close()`)."""
        if self._scratch_cleanup is not None:
            self._scratch_cleanup()

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


def _log_failure(what: str) -> Any:
    """A done-callback for a future nobody waits for: its failure goes to the log, not nowhere."""

    def check(fut: concurrent.futures.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("%s failed: %s", what, fut.exception())

    return check
