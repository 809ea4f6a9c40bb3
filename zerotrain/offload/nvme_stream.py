"""The NVMe offload step's pipeline (`nvme.py`): records streamed through the buffer pool, and kept between steps.

A step is bound by the disk: the Adam update of a 4M-element chunk takes a few milliseconds,
its record (fp32 master + exp_avg + exp_avg_sq, 48 MiB) a few tens to read and to write. So
the pipeline reads ahead as far as the pool allows (`pool.count` records in flight), updates a
chunk as soon as its read is done, and writes it behind while the next ones are read.

Kept records: after a committed step, the buffers of the last `pool.count - 1` chunks still hold
exactly what was just written to the new current slot. Instead of giving them back to the pool
(where they would only be overwritten), the step keeps them (`_kept`), and the next step updates
those chunks first, without reading them: their reads vanish from the disk's work and the update
starts at once, while the reads of the other chunks are already in flight. One buffer always
stays free, so paging, publishing and rollback can still take one. It costs no memory (the pool
is allocated anyway). A kept record is dropped whenever its chunk's current record changes
outside a step (`_drop_kept`: a master written from outside, records written back from memory)
and after a step that did not commit; a step that fails therefore reads everything from disk
again, exactly as before the kept records existed.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Iterable, Optional

import torch

from .nvme_records import _Chunk


class NvmeStream:
    """The streaming step and the kept records of `NvmeOffloadOptimizer` (a mixin: see nvme.py)."""

    _kept: dict[_Chunk, torch.Tensor]

    def _drop_kept(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Give the buffers of the kept records (of `buckets`, else all) back to the pool."""
        wanted = None if buckets is None else set(buckets)
        for chunk in [c for c in self._kept if wanted is None or c.bucket in wanted]:
            self.pool.release(self._kept.pop(chunk))

    def _stream(self, chunks: list[_Chunk], grad_shards, multiplier: float, stepped: list[_Chunk],
                keep: dict[_Chunk, torch.Tensor]) -> dict:
        """Read, update (and publish) and write back `chunks`, appending each to `stepped` before it changes.

        Kept records go first and are not read. Returns the new scalar states by bucket and puts the
        buffers of the last `pool.count - 1` chunks, written, into `keep` (the caller keeps them only
        when the step commits). On failure every I/O in flight is waited for, every buffer goes back
        to the pool and the error is raised; the slots are untouched."""
        held = {chunk: self._kept.pop(chunk) for chunk in chunks if chunk in self._kept}
        self._drop_kept()  # records of chunks not stepped now: their buffers serve this step's reads
        order = [c for c in chunks if c in held] + [c for c in chunks if c not in held]
        fetched: dict[int, tuple[torch.Tensor, Optional[Future]]] = {
            position: (held[chunk], None) for position, chunk in enumerate(order[:len(held)])}
        writes: list[Future] = []
        keeping: dict[_Chunk, torch.Tensor] = {}  # the tail's buffers: not released when written
        keep_from = len(order) - (self.pool.count - 1)
        scalars: dict = {}
        holding, ahead = None, len(held)  # holding: (buffer, its read) of the chunk being updated
        try:
            for k, chunk in enumerate(order):
                while ahead < len(order) and ahead - k < self.pool.count:
                    buffer = self.pool.acquire(block=ahead == k)  # blocks only on writes behind: they free buffers
                    if buffer is None:
                        break
                    following = order[ahead]
                    fetched[ahead] = (buffer, self.io.read(self.files[self.slot[following.bucket]], following.offset,
                                                           self._record(following, buffer)))
                    ahead += 1
                holding = fetched.pop(k)
                if holding[1] is not None:
                    holding[1].result()
                for future in writes:
                    if future.done() and future.exception() is not None:
                        raise future.exception()
                stepped.append(chunk)
                self._step_chunk(chunk, holding[0], grad_shards[chunk.bucket], multiplier, scalars)
                buffer = holding[0]
                release = None if k >= keep_from else (lambda b=buffer: self.pool.release(b))
                writes.append(self.io.write(self.files[1 - self.slot[chunk.bucket]], chunk.offset,
                                            self._record(chunk, buffer), done=release))
                if k >= keep_from:
                    keeping[chunk] = buffer
                holding = None
            for future in writes:
                future.result()
        except BaseException:
            for buffer, future in list(fetched.values()) + ([holding] if holding is not None else []):
                if future is not None:
                    _quietly_wait([future])
                self.pool.release(buffer)
            _quietly_wait(writes)
            for buffer in keeping.values():
                self.pool.release(buffer)
            raise
        keep.update(keeping)
        return scalars


def _quietly_wait(futures) -> None:
    for future in futures:
        try:
            future.result()
        except BaseException:  # noqa: BLE001 - the first error is the one raised
            pass
