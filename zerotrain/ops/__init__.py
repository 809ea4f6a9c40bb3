"""`zerotrain.ops`: the DeepSpeed op modules that training programs import, as torch's optimizers.

`zerotrain.ops.adam` has `FusedAdam` and `DeepSpeedCPUAdam` (torch's AdamW/Adam with DeepSpeed's
signature and defaults). DeepSpeed's compiled kernels are not needed here: the engine steps its fp32
master shards with the optimizer passed (on the device, or on the CPU under `offload_optimizer`).
"""
from . import adam

__all__ = ["adam"]
