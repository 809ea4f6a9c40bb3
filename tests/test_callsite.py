"""zerotrain.callsite: the frame a warning names, in-process (the warning sites' own tests check the user's line
through the public paths: tests/zero/test_stage3_init_ops.py, tests/checkpoint/test_ckpt_world_of_one.py,
tests/config/test_config_base.py)."""
from __future__ import annotations

import os
import sys
import warnings

from zerotrain.callsite import frame_outside, stacklevel_outside


def _outermost() -> tuple[str, int]:
    frame = sys._getframe()
    while frame.f_back is not None:
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


def test_the_first_frame_outside_is_the_callers_own_when_it_is_outside():
    here = sys._getframe()
    assert frame_outside() is here
    assert stacklevel_outside() == 1  # warnings.warn(stacklevel=1) names this line


def test_frames_inside_the_given_directories_are_skipped_up_to_the_first_outside():
    tests_dir = os.path.dirname(os.path.abspath(__file__))

    def inner():  # in tests/: skipped, as this test itself is
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            warnings.warn("where", stacklevel=stacklevel_outside(tests_dir))
        return frame_outside(tests_dir), said

    found, said = inner()
    caller = sys._getframe().f_back  # pytest's frame that called this test: the first outside tests/
    assert found is caller
    assert [(w.filename, w.lineno) for w in said] == [(caller.f_code.co_filename, caller.f_lineno)]


def test_with_every_frame_inside_none_is_found_and_the_warning_names_the_outermost_frame():
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        warnings.warn("where", stacklevel=stacklevel_outside(os.sep))
    assert frame_outside(os.sep) is None
    assert [(w.filename, w.lineno) for w in said] == [_outermost()]
