"""The error every merge failure raises; its message names the tensor, file or setting at fault."""
from __future__ import annotations


class MergeError(ValueError):
    """A merge cannot be done as configured (bad input, mismatched models, bad parameter)."""
