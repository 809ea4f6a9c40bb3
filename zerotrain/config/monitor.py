"""DeepSpeed's monitor blocks: `tensorboard`, `csv_monitor`, `wandb`, with its keys and defaults
(deepspeed/monitor/config.py). `zerotrain.monitor` writes them; `comet` stays accepted without effect."""
from __future__ import annotations

from typing import Optional

from .base import Block, Bool

__all__ = ["TensorBoardConfig", "CSVMonitorConfig", "WandbConfig"]


class TensorBoardConfig(Block):
    """`tensorboard`: event files in `output_path/job_name` ("" : the current directory)."""

    PATH = "tensorboard"

    enabled: Bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CSVMonitorConfig(Block):
    """`csv_monitor`: one CSV file per event in `output_path/job_name`."""

    PATH = "csv_monitor"

    enabled: Bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Block):
    """`wandb`: `wandb.init(project=, group=, entity=team)`; offline unless WANDB_MODE says otherwise."""

    PATH = "wandb"

    enabled: Bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"
