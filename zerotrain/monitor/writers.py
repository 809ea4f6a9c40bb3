"""DeepSpeed's `tensorboard`, `csv_monitor` and `wandb` monitors, fed by the metrics records.

Same config keys and the same places as DeepSpeed 0.19.8 (deepspeed/monitor/): TensorBoard events and CSV
files go to `output_path/job_name` (`output_path` "" means the current directory), CSV files are one per
event, named after the event with `/` replaced by `_`, with a `step,<last part of the name>` header
(`step` holds the x value, global samples); wandb runs `wandb.init(project=, group=, entity=team)` and logs
each record's events at step=global samples. The libraries do the writing: torch's `SummaryWriter` (needs
the `tensorboard` package), the `csv` module, `wandb`. wandb runs offline unless `WANDB_MODE` is set (no
network at run time). Only rank 0 builds monitors (`Monitors.build` is called there); every rank calls
`check_monitor_libraries` first, so a missing library stops all ranks with the same error.
"""
from __future__ import annotations

import csv
import importlib
import os
from pathlib import Path
from typing import Any, Optional

from ..config import ConfigError
from .schema import events

__all__ = ["Monitors", "check_monitor_libraries", "MonitorUnavailable", "EXTRAS"]

# config block -> (import name, the zerotrain extra that installs it)
EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


class MonitorUnavailable(ConfigError):
    """A monitor block is enabled but its library is not installed (a config error: the CLI prints one line)."""


def _enabled(config: Any, block: str) -> bool:
    return bool(getattr(getattr(config, block, None), "enabled", False))


def check_monitor_libraries(config: Any) -> None:
    """Raise MonitorUnavailable naming the key and the pip extra for an enabled block whose library is missing."""
    for block, (module, extra) in EXTRAS.items():
        if not _enabled(config, block):
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            raise MonitorUnavailable(
                f"{block}.enabled is true, but the {module!r} package is not installed: "
                f"pip install 'zerotrain[{extra}]' (or set {block}.enabled to false)",
                key=f"{block}.enabled") from None


def _log_dir(block: Any) -> Path:
    return Path(block.output_path or ".") / block.job_name


class TensorBoardMonitor:
    def __init__(self, block: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = _log_dir(block)
        self.path.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.path))

    def write(self, batch: list[tuple[str, float, int]]) -> None:
        for name, value, x in batch:
            self.writer.add_scalar(name, value, x)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CSVMonitor:
    def __init__(self, block: Any) -> None:
        self.path = _log_dir(block)
        self.path.mkdir(parents=True, exist_ok=True)
        self._started: set[str] = set()

    def write(self, batch: list[tuple[str, float, int]]) -> None:
        for name, value, x in batch:
            filename = name.replace("/", "_").replace(" ", "_")
            file = self.path / f"{filename}.csv"
            with open(file, "a", newline="", encoding="utf-8") as handle:
                writer = csv.writer(handle)
                if filename not in self._started:  # DeepSpeed writes the header once per run (a resume adds one)
                    self._started.add(filename)
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([x, value])

    def close(self) -> None:
        pass


class WandbMonitor:
    def __init__(self, block: Any, directory: Optional[Path]) -> None:
        os.environ.setdefault("WANDB_MODE", "offline")  # no network at run time; `WANDB_MODE=online` to sync
        import wandb

        kwargs = {"dir": str(directory)} if directory is not None else {}
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=block.project, group=block.group, entity=block.team, **kwargs)
        self.path = Path(self.run.dir).parent if getattr(self.run, "dir", None) else None

    def write(self, batch: list[tuple[str, float, int]]) -> None:
        if batch:
            self.run.log({name: value for name, value, _ in batch}, step=batch[0][2])

    def close(self) -> None:
        """Finish the run with its records on disk. wandb's `finish()` only hands the run's end to wandb-core (its
        service process): offline, the `.wandb` file can still hold its 7-byte header alone when `finish()` returns,
        and the rows land later, or never when the job exits first. `wandb.teardown()` waits for the service to
        write and close every stream; it would also finish other open runs, so it runs only when this was the
        process's last one (a user's own run keeps going; its records then reach disk at its own finish)."""
        import wandb

        self.run.finish()
        if wandb.run is None:
            wandb.teardown()


class Monitors:
    """The enabled monitors of one run (rank 0 only): `write(record)` sends a metrics record to each."""

    def __init__(self, monitors: dict[str, Any]) -> None:
        self.monitors = monitors

    @classmethod
    def build(cls, config: Any, log_dir: Optional[Path] = None) -> "Monitors":
        """The monitors `config` enables; wandb's files go under `log_dir` when there is one."""
        check_monitor_libraries(config)
        monitors: dict[str, Any] = {}
        if _enabled(config, "tensorboard"):
            monitors["tensorboard"] = TensorBoardMonitor(config.tensorboard)
        if _enabled(config, "csv_monitor"):
            monitors["csv_monitor"] = CSVMonitor(config.csv_monitor)
        if _enabled(config, "wandb"):
            monitors["wandb"] = WandbMonitor(config.wandb, log_dir)
        return cls(monitors)

    def __bool__(self) -> bool:
        return bool(self.monitors)

    def paths(self) -> dict[str, str]:
        """Where each monitor writes: block name -> directory."""
        return {name: str(m.path) for name, m in self.monitors.items() if m.path is not None}

    def write(self, record: dict[str, Any]) -> None:
        if self.monitors:
            batch = list(events(record))
            for monitor in self.monitors.values():
                monitor.write(batch)

    def close(self) -> None:
        for monitor in self.monitors.values():
            monitor.close()
