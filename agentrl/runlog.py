"""Quiet consoles: engine logs go to a file in the run directory, library progress bars stay off.

A training run's console is ours: a progress bar and a handful of lines. vLLM's engine logs (start-up,
KV cache sizes, deprecation notes), its Python warnings, transformers' "Loading weights" bars and
PyTorch's C++ warnings would bury them, so `quiet_libraries(log_file)` sends vLLM's logger to
`log_file` (in the engine's own processes too: they read VLLM_LOGGING_CONFIG_PATH) and turns the
rest off. `agentrl --debug` leaves everything as the libraries set it.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import warnings
from pathlib import Path


def debug_mode() -> bool:
    return os.environ.get("AGENTRL_DEBUG", "") not in ("", "0")


def vllm_file_logging(log_file: Path) -> dict:
    """A `logging.config.dictConfig` that sends every `vllm` record of INFO and above to `log_file`."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {
                "format": "%(levelname)s %(asctime)s [%(process)d %(filename)s:%(lineno)d] %(message)s",
                "datefmt": "%m-%d %H:%M:%S",
            }
        },
        "handlers": {
            "vllm": {
                "class": "logging.FileHandler",
                "filename": str(log_file),
                "formatter": "vllm",
                "level": "INFO",
            }
        },
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
    }


def quiet_libraries(log_file: Path | None) -> None:
    """Route vLLM's logs to `log_file` (None: leave them) and silence library progress bars and
    deprecation chatter. Idempotent; a no-op in debug mode."""
    if debug_mode():
        return
    if log_file is not None:
        log_file = Path(log_file).resolve()
        log_file.parent.mkdir(parents=True, exist_ok=True)
        config = vllm_file_logging(log_file)
        config_path = log_file.with_name(".vllm-logging.json")
        config_path.write_text(json.dumps(config))
        # Read by vLLM at import and by every engine process it spawns (they inherit the environment).
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)
        os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
        # Now as well: vLLM may already be imported (and configured), and a record logged while it
        # imports, before it configures its logger, would reach Python's last-resort stderr handler.
        logging.config.dictConfig(config)
    # vLLM's own deprecation warnings about torch APIs are not the user's to act on: here, and in
    # the engine processes it spawns (PYTHONWARNINGS names modules exactly).
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"vllm(\.|$)")
    engine_filter = "ignore::FutureWarning:vllm.triton_utils.dispatcher"
    current = os.environ.get("PYTHONWARNINGS", "")
    if engine_filter not in current:
        os.environ["PYTHONWARNINGS"] = f"{current},{engine_filter}" if current else engine_filter
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars
    except Exception:  # pragma: no cover - transformers is a dependency
        pass
