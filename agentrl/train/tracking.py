"""Where training metrics go: `report_to: [jsonl, tensorboard, wandb]`.

- `jsonl`: `out/metrics.jsonl`, one row per step. Always written: the training plot, the demo and
  resuming read it.
- `tensorboard`: scalars under `out/tb` (`torch.utils.tensorboard`); a resumed run purges the
  steps after its checkpoint, so the curves do not fork.
- `wandb`: Weights & Biases. Without an account it logs offline under `out/wandb` (`wandb sync`
  uploads later); a resumed run continues the same W&B run (its id is kept in `out/wandb-run-id`).

tensorboard and wandb are the `tracking` extra (`pip install 'agentrl[tracking]'`); `check_available`
says so in one line before a run starts rather than failing after the first step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import uuid
from pathlib import Path
from typing import Any

from agentrl.core.errors import UserError

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_available(report_to: list[str]) -> None:
    """A `UserError` naming the missing package when a chosen backend is not installed."""
    for backend in report_to:
        package = _PACKAGES.get(backend)
        if package and importlib.util.find_spec(package) is None:
            raise UserError(
                f"report_to has {backend} but the {package} package is not installed: "
                "pip install 'agentrl[tracking]' (or drop it from report_to)"
            )


def wandb_mode(requested: str) -> str | None:
    """The W&B mode to pass: WANDB_MODE wins (None lets W&B read it); `auto` is online only with a key."""
    if os.environ.get("WANDB_MODE"):
        return None
    if requested != "auto":
        return requested
    has_key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has_wandb_key()
    return "online" if has_key else "offline"


def _netrc_has_wandb_key() -> bool:
    """Whether the netrc file ($NETRC, else ~/.netrc) holds a login for the W&B server this `wandb` talks
    to: its own default, or WANDB_BASE_URL (`wandb login` writes it there)."""
    import netrc
    import urllib.parse

    import wandb

    settings = wandb.Settings()
    # What `wandb.init` would read: its settings file (`wandb login --host`), then the environment.
    # (Methods of wandb's settings since 0.19; an older or newer wandb without them keeps its default.)
    with contextlib.suppress(Exception):
        settings.update_from_system_settings()
    with contextlib.suppress(Exception):
        settings.update_from_env_vars(dict(os.environ))
    host = urllib.parse.urlparse(settings.base_url).hostname
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if not host or not path.is_file():
        return False
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (netrc.NetrcParseError, OSError):  # a file netrc refuses (its permissions): read it as text
        return host in path.read_text(errors="ignore").split()


class Tracker:
    """Metrics of one run to every chosen backend; `log(step, metrics)`, then `close()`."""

    def __init__(self, cfg: Any, out: Path, resumed_at: int = 0):
        check_available(cfg.report_to)
        self.out = out
        self.jsonl = out / "metrics.jsonl"
        self.tb: Any = None
        self.wandb_run: Any = None
        self.notes: list[str] = []
        if "tensorboard" in cfg.report_to:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events logged after the checkpoint we resume from (a killed run's tail).
            self.tb = SummaryWriter(str(out / "tb"), purge_step=resumed_at + 1 if resumed_at else None)
            self.notes.append(f"TensorBoard: tensorboard --logdir {out / 'tb'}")
        if "wandb" in cfg.report_to:
            self.wandb_run = self._start_wandb(cfg, out)

    def _start_wandb(self, cfg: Any, out: Path) -> Any:
        import wandb

        id_file = out / "wandb-run-id"
        # W&B run ids are short lowercase alphanumerics; a resumed run reuses the one on disk.
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        mode = wandb_mode(cfg.wandb.mode)
        run = wandb.init(
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            name=cfg.wandb.name,
            id=run_id,
            resume="allow",
            dir=str(out),
            mode=mode,
            config=json.loads(cfg.model_dump_json()),
            # Our own progress bar and lines stay readable: W&B neither captures the console nor
            # prints its banner.
            settings=wandb.Settings(console="off", quiet=True, silent=True),
        )
        where = f"offline in {out / 'wandb'} (upload later: wandb sync {out / 'wandb'}/offline-run-*)"
        self.notes.append(f"W&B: {where}" if (mode or run.settings.mode) == "offline" else f"W&B: {run.url}")
        return run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: round(v, 6) for k, v in metrics.items()}}
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(dict(metrics), step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
