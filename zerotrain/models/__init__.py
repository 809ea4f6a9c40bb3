"""Models that ship with zerotrain (the workloads of its tests, demo and benchmarks)."""
from zerotrain.models.gpt import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS"]
