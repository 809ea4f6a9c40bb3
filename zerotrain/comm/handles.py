"""Byte counters, the collective error, and the handles every transport returns.

`CommCounters` counts calls and bytes per collective kind (ring bytes, see `core`);
`CollectiveError` names the collective and the rank when a peer died or did not answer;
`_Named` wraps a transport's handle so its wait() raises that error; `Completed` is the handle of
a collective that had nothing to do (a world of one).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class CommCounters:
    """Calls and bytes sent per collective kind since start.

    Compressed collectives (kinds ending in `_q4` / `_q8`, see `zerotrain.comm.compressed`)
    also count `logical_bytes`: what the same collective would have sent uncompressed, in the
    data's own dtype, so `bytes / logical_bytes` is the compression ratio on the wire.
    """

    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    logical: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: float, logical_bytes: Optional[float] = None) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += int(nbytes)
        if logical_bytes is not None:
            self.logical[kind] += int(logical_bytes)

    def snapshot(self) -> dict:
        out = {}
        for kind in sorted(self.calls):
            entry = {"calls": self.calls[kind], "bytes": self.bytes[kind]}
            if kind in self.logical:
                entry["logical_bytes"] = self.logical[kind]
            out[kind] = entry
        return out


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer rank died or did not answer within the group's timeout."""


def _failure(kind: str, rank: int, size: int, error: BaseException) -> CollectiveError:
    return CollectiveError(f"{kind} failed on rank {rank} of {size} (did a peer rank die, or not answer "
                           f"within comm_timeout_seconds?): {error}")


class _Named:
    """A collective's handle whose wait() names the collective when it fails."""

    def __init__(self, work, kind: str, rank: int, size: int,
                 explain: Optional[Callable[[BaseException], CollectiveError]] = None):
        """`explain(error)`: the error to raise instead of the plain one (e.g. naming the peers at fault)."""
        self._work, self._kind, self._rank, self._size, self._explain = work, kind, rank, size, explain

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        except (RuntimeError, OSError) as error:
            if self._explain is not None:
                raise self._explain(error) from error
            raise _failure(self._kind, self._rank, self._size, error) from error

    def __getattr__(self, name):
        return getattr(self._work, name)


class Completed:
    """A finished handle, so callers can wait() uniformly in a world of one (or with nothing to reduce)."""

    def wait(self) -> bool:
        return True


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
