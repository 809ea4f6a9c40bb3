"""Hooks on parameters that do not keep their owner alive.

A parameter holds its gradient hooks in C++ (its autograd metadata), where Python's garbage collector
cannot see them. A hook that is a bound method of a reducer or a stage-3 hook set holds that object, which
holds the parameters (its buckets, its fetcher's parts): a cycle the collector cannot break. A finished
engine's reducer, its communicators and their process groups then live until the interpreter ends, and
gloo's worker threads with them: a worker that drops a finished collective's tensors while the interpreter
finalizes must take the GIL and aborts the process ("terminate called without an active exception").
So the hook holds its owner weakly: the engine owns the reducer; the parameter does not.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """A hook calling the bound `method` while its object lives, and nothing once it is gone."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return hook
