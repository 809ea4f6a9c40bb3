"""`zerotrain.utils`: the small helpers DeepSpeed programs import from `deepspeed.utils`.

`logger` and `log_dist` (logging on chosen ranks), `RepeatingLoader` (a data loader that restarts at its
end), and `module_utils.recursive_getattr` / `recursive_setattr` (dotted-name access to submodules).
"""
from .logging import log_dist, logger
from .module_utils import recursive_getattr, recursive_setattr
from .repeating import RepeatingLoader

__all__ = ["logger", "log_dist", "RepeatingLoader", "recursive_getattr", "recursive_setattr"]
