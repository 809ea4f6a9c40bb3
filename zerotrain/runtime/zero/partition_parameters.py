"""`deepspeed.runtime.zero.partition_parameters`' names: `ZeroParamStatus` (the `ds_status` of a partitioned
parameter: AVAILABLE while gathered, NOT_AVAILABLE while only its shard is here), `GatheredParameters`, `Init`."""
from ...zero import GatheredParameters, Init
from ...zero.stage3 import ZeroParamStatus

__all__ = ["ZeroParamStatus", "GatheredParameters", "Init"]
