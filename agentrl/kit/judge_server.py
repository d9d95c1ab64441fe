"""A checkpoint served as an OpenAI-compatible judge by vLLM's own server, on this machine.

    with serve_judge("runs/tiny", name="judge") as url:     # http://127.0.0.1:PORT/v1
        JudgeVerifier(base_url=url, model="judge", rubric=[...], constrain=True)

vLLM's OpenAI server (`vllm.entrypoints.openai.api_server`), not the gateway: a judge needs neither
sessions nor token records, and it needs what the gateway does not do, constrained decoding
(`structured_outputs`), so that a small model answers in the judge's format. On CPU it runs with the
engine's CPU settings (`agentrl.rollout.policy.vllm_cpu_env`: one pinned OpenMP thread, 1 GiB of KV cache).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_judge(
    model: str | Path, *, name: str = "judge", max_model_len: int = 2048, start_timeout_s: float = 600.0
) -> Iterator[str]:
    """Serve `model` (a checkpoint directory) until the block ends; yields the endpoint's base URL."""
    from agentrl.rollout.policy import vllm_cpu_env

    port = _free_port()
    env = {**os.environ}
    try:
        import torch

        on_gpu = torch.cuda.is_available()
    except Exception:
        on_gpu = False
    if not on_gpu:
        env.update(vllm_cpu_env(threads=1, kv_cache_gib=1, in_process=True))
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--served-model-name", name, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", "float32" if not on_gpu else "auto", "--max-model-len", str(max_model_len)]
    argv += ["--max-num-seqs", "8", "--disable-log-stats"]
    if not on_gpu:
        argv += ["--enforce-eager"]  # as the rollout engine: no torch.compile on CPU (minutes of C++ builds)
    # The server's log goes to a file (a pipe nobody reads would fill and stall it); its end names a failure.
    log = tempfile.NamedTemporaryFile(prefix="agentrl-judge-server-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                err = Path(log.name).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"vLLM's OpenAI server for {model} exited ({proc.returncode}): {err}")
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM's OpenAI server for {model} did not answer within {start_timeout_s:g}s"
                )
            time.sleep(1.0)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(10)
        log.close()
        Path(log.name).unlink(missing_ok=True)
