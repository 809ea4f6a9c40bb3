"""Where a warning points: the first frame of the call stack outside given directories (the user's line).

A warning raised deep inside zerotrain (or inside torch's module recursion, or pydantic's validators) should
name the line of the user's program that led to it — the `state_dict()` call, the `save_checkpoint` or `step()`
line, the `initialize(config=...)` call — however many frames of library code lie in between. Python 3.12's
`warnings.warn(skip_file_prefixes=...)` does this; the project supports 3.10 and 3.11, so this walks the stack
itself (one walker for every warning site that needs it)."""
from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Optional

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))  # zerotrain/


def _walk(frame: FrameType, prefixes: tuple[str, ...]) -> tuple[Optional[FrameType], FrameType, int]:
    """From `frame` outwards: (the first frame outside `prefixes` or None, the last frame visited, frames gone up)."""
    inside = tuple(os.path.join(os.path.abspath(prefix), "") for prefix in prefixes)
    level, last = 0, frame
    while frame is not None:
        if not os.path.abspath(frame.f_code.co_filename).startswith(inside):
            return frame, frame, level
        last, frame, level = frame, frame.f_back, level + 1
    return None, last, level - 1


def stacklevel_outside(*directories: str) -> int:
    """The `stacklevel` that the function calling this one gives `warnings.warn` so that the warning names the
    first frame outside `directories` (zerotrain's own directory is always among them); when every frame is
    inside, the outermost one."""
    _, frame, level = _walk(sys._getframe(1), (PACKAGE_DIR, *directories))
    return level + 1


def frame_outside(*directories: str) -> Optional[FrameType]:
    """The first frame outside `directories` and zerotrain's own directory, from the function calling this one
    outwards; None when there is none."""
    found, _, _ = _walk(sys._getframe(1), (PACKAGE_DIR, *directories))
    return found
