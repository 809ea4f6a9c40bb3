"""`recursive_getattr` / `recursive_setattr`: a submodule (or attribute) by its dotted name, as DeepSpeed's
`deepspeed.utils.module_utils` (DeepSpeed-Chat's LoRA conversion replaces layers by name with them)."""
from __future__ import annotations

from typing import Any

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """`model.a.b.c` for `module_name` "a.b.c"."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set `model.a.b.c = module` for `module_name` "a.b.c"."""
    *parents, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(parents)) if parents else model, last, module)
