"""Metrics and monitors: the `metrics.jsonl` schema (`schema`), what a step measures (`measure`), the
engine's wall-clock timers (`timers`), DeepSpeed's `engine.tput_timer` (`throughput`), the per-rank memory timeline (`memory_timeline`) and DeepSpeed's `tensorboard` / `csv_monitor` / `wandb` monitors
(`writers`). See docs/metrics.md."""
from .schema import DEEPSPEED_EVENTS, EVENT_PREFIX, FIELDS, TIMER_FIELDS, events
from .memory_timeline import MemoryTimeline
from .throughput import ThroughputTimer
from .timers import TIMER_NAMES, WallClockTimers
from .writers import EXTRAS, MonitorUnavailable, Monitors, check_monitor_libraries

__all__ = ["FIELDS", "EVENT_PREFIX", "DEEPSPEED_EVENTS", "TIMER_FIELDS", "events", "WallClockTimers",
           "TIMER_NAMES", "ThroughputTimer", "MemoryTimeline", "Monitors", "MonitorUnavailable", "check_monitor_libraries", "EXTRAS"]
