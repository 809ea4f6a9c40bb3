"""`deepspeed.runtime.zero`'s names (Megatron-DeepSpeed: `from deepspeed.runtime.zero import GatheredParameters`)."""
from ...zero import GatheredParameters, Init
from . import partition_parameters

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
