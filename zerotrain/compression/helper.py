"""`recursive_getattr` / `recursive_setattr` where DeepSpeed-Chat imports them from (`deepspeed.compression.helper`):
the ones of `zerotrain.utils.module_utils`, the path to prefer."""
from ..utils.module_utils import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
