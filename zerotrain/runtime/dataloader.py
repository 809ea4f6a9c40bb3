"""`deepspeed.runtime.dataloader`'s `RepeatingLoader` (a loader that starts again at its end)."""
from ..utils.repeating import RepeatingLoader

__all__ = ["RepeatingLoader"]
