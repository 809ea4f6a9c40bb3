"""ZeRO stage 3: parameters partitioned across ranks, gathered per module with prefetch."""
from .context import GatheredParameters, Init, check_init_partitions
from .partition import PartitionedParam, ZeroParameter, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "check_init_partitions", "PartitionedParam", "ZeroParameter", "ZeroParamStatus"]
