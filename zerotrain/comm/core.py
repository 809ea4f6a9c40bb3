"""Collectives with byte counters: the only code that calls torch.distributed collectives.

Every collective goes through a :class:`Comm`, which counts what it moves so that
tests and benchmarks can check communication volume against theory. Bytes are
counted as a ring algorithm sends them from one rank: an all-reduce of S bytes
sends 2·S·(N−1)/N, a reduce-scatter or all-gather of a full buffer of S bytes
sends S·(N−1)/N. In a world of one nothing is sent and nothing is counted.

A collective that fails (a peer died, or did not answer within the group's
timeout) raises :class:`CollectiveError` naming the collective and this rank,
whether it fails at the call or at the handle's `wait()`.

On gloo (CPU tensors), reduce-scatter and all-gather do not use gloo's own collectives:
gloo runs `reduce_scatter_single` as a clone of the whole input plus a full all-reduce,
and `all_gather_single` through staging copies, both 2-3x slower than the bytes they
move (benchmarks/gloo_collectives.py). Instead every rank sends each peer that peer's
chunk directly (`isend`/`irecv`) and sums what it received locally (reduce-scatter), or
receives every peer's chunk in place (all-gather). That sends exactly the ring bytes the
counters count, from the transport's own threads, so it overlaps with compute. When every
rank of the group is on this host, the same exchanges skip the sockets: each rank reads its
peers' chunks straight from their memory (`zerotrain.comm.same_host`). NCCL keeps the
native collectives.
"""
from __future__ import annotations

import datetime
import weakref
from collections import defaultdict
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..topology import Topology
from . import blame, same_host
from .handles import CollectiveError, CommCounters, Completed, _failure, _Named, _nbytes

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_object(output: list, obj, async_op: bool = False, **kwargs) -> None:
    """torch's all_gather_object in `Comm._call`'s form (it has no async form)."""
    dist.all_gather_object(output, obj, **kwargs)


class _PointToPoint:
    """Handle of one collective built from point-to-point transfers: wait() waits for every
    transfer (naming the collective on failure), then runs the local `finish` step once."""

    def __init__(self, works: list, finish: Optional[Callable[[], None]], kind: str, rank: int, size: int,
                 peers: Optional[list[str]] = None):
        """`peers[i]`: what `works[i]` waits for, e.g. "a receive from global rank 2" (named in a failure)."""
        self._works, self._finish, self._kind, self._rank, self._size = works, finish, kind, rank, size
        self._peers = peers or [""] * len(works)

    def wait(self) -> bool:
        index = 0
        try:
            for index, work in enumerate(self._works):
                work.wait()
        except RuntimeError as error:
            peer = self._peers[index]  # a dead host or a cut link: the peer this rank waited on
            raise _failure(self._kind + (f" ({peer})" if peer else ""), self._rank, self._size, error) from error
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None and not self._works


# Next point-to-point tag per process group (by group name), shared by every Comm on that
# group, so two Comms over one group never post matching tags for different transfers.
_NEXT_TAG: dict[str, int] = defaultdict(int)

# Same-host transport per process group, keyed by the group object's id (the entry keeps the
# group alive, so the id is not reused): None where the group's ranks cannot use it.
_SAME_HOST: dict[int, tuple] = {}


def release_groups() -> None:
    """Forget the process groups this module holds (each same-host transport's entry keeps its group alive):
    called when torch.distributed is torn down, so that a destroyed group, and gloo's worker threads with it, is
    not kept until the interpreter exits. (The point-to-point tags hold no group: every rank keeps the same.)"""
    _SAME_HOST.clear()


class _Then:
    """A collective's handle whose `wait()` runs `finish` once the collective is done (once)."""

    def __init__(self, work, finish: Callable[[], None]):
        self.work, self.finish = work, finish

    def wait(self) -> bool:
        if self.finish is not None:
            self.work.wait()
            finish, self.finish = self.finish, None
            finish()
        return True


class Comm:
    """Collectives over one process group, with byte counters."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, size: int,
                 counters: Optional[CommCounters] = None, *, gloo_point_to_point: bool = True,
                 same_host_transport: bool = True, timeout_seconds: float = 1800.0):
        """`gloo_point_to_point=False` keeps gloo's own reduce-scatter and all-gather (for comparison);
        `same_host_transport=False` keeps their point-to-point version on gloo's sockets even when
        every rank is on this host (also `ZEROTRAIN_SAME_HOST_TRANSPORT=0`)."""
        # Held weakly: torch.distributed owns its groups (until `destroy_process_group`), and a Comm outlives
        # its run wherever a finished model keeps its hooks (stage 3's fetcher, a wrapped `generate`) and the
        # script keeps the model: a strong reference would keep a destroyed group, and gloo's worker threads,
        # into the interpreter's exit, where a worker dropping its last collective's tensors aborts the process.
        self._group = weakref.ref(group) if isinstance(group, dist.ProcessGroup) else (lambda: group)
        self._holds_group = group is not None
        self.rank = rank
        self.size = size
        self.counters = counters if counters is not None else CommCounters()
        self.gloo_point_to_point = gloo_point_to_point
        self.same_host_transport = same_host_transport
        self.timeout_seconds = timeout_seconds
        self._cpu_backend_is_gloo: Optional[bool] = None
        self._global_ranks: Optional[list[int]] = None

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The process group (None: the default one); an error once torch.distributed destroyed it."""
        group = self._group()
        if group is None and self._holds_group:
            raise RuntimeError(f"zerotrain.comm: rank {self.rank}'s process group of {self.size} was destroyed "
                               "(torch.distributed was torn down); this Comm can run no more collectives")
        return group

    @classmethod
    def data_parallel(cls, topology: Topology, counters: Optional[CommCounters] = None) -> "Comm":
        return cls(topology.dp_group, topology.dp_rank, topology.dp_size, counters,
                   same_host_transport=topology.same_host_transport, timeout_seconds=topology.timeout_seconds)

    @classmethod
    def tensor_parallel(cls, topology: Topology, counters: Optional[CommCounters] = None) -> "Comm":
        """Collectives over this rank's tensor-parallel group."""
        return cls(topology.tp_group, topology.tp_rank, topology.tp_size, counters,
                   same_host_transport=topology.same_host_transport, timeout_seconds=topology.timeout_seconds)

    @classmethod
    def pipeline(cls, topology: Topology, counters: Optional[CommCounters] = None) -> "Comm":
        """Collectives over this rank's pipeline group (the ranks at its place in every stage)."""
        return cls(topology.pp_group, topology.pp_rank, topology.pp_size, counters,
                   same_host_transport=topology.same_host_transport, timeout_seconds=topology.timeout_seconds)

    def subgroup(self, group: Optional[dist.ProcessGroup], rank: int, size: int) -> "Comm":
        """A Comm over another group, with this one's counters and settings."""
        return Comm(group, rank, size, self.counters, gloo_point_to_point=self.gloo_point_to_point,
                    same_host_transport=self.same_host_transport, timeout_seconds=self.timeout_seconds)

    def _ring_fraction(self) -> float:
        return (self.size - 1) / self.size

    def _call(self, kind: str, collective, *args, async_op: bool = False, **kwargs):
        """Run a torch.distributed collective, naming it in any failure (sync, or at the handle's wait), and
        the peers that never reached it (`comm.blame`: gloo's own errors name none)."""
        number = blame.next_number(self._group_name())
        try:
            work = collective(*args, async_op=async_op, **kwargs)
        except RuntimeError as error:
            raise self._blamed(kind, number, error) from error
        if not async_op:
            return work
        return _Named(work, kind, self.rank, self.size, explain=lambda error: self._blamed(kind, number, error))

    def _blamed(self, kind: str, number: int, error: BaseException) -> CollectiveError:
        members = [self._global(r) for r in range(self.size)]
        clause = blame.silent_members(self._group_name(), number, members, self.timeout_seconds)
        return _failure(f"{kind} ({clause})", self.rank, self.size, error)

    def _group_name(self) -> str:
        if self.group is None or self.group == dist.group.WORLD:
            return "WORLD"
        return getattr(self.group, "group_name", str(id(self.group)))

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False, *,
                   kind: str = "all_reduce"):
        """In-place all-reduce of `tensor`; `kind` names the counter (e.g. "all_reduce_fp8_amax")."""
        if self.size == 1:
            return Completed() if async_op else None
        self.counters.add(kind, 2 * _nbytes(tensor) * self._ring_fraction())
        return self._call(kind, dist.all_reduce, tensor, op=op, group=self.group, async_op=async_op)

    def barrier(self) -> None:
        """Wait until every rank of the group gets here (gloo: torch's barrier).

        Not an all-reduce: gloo retires a finished work on its own thread after waking the caller, and an
        all-reduce's work holds a tensor made in Python, whose release needs the GIL. When that is the last
        collective before the process exits (the barrier before tearing the groups down), the interpreter may
        already be finalizing, and the thread's GIL request ends the process in std::terminate (seen as a
        rank dying by SIGABRT after a finished run, ~8% of runs under load). A barrier's work holds no tensor."""
        if self.size == 1:
            return
        self._call("barrier", dist.barrier, group=self.group)

    # --- gloo: reduce-scatter and all-gather from point-to-point transfers ----------------------
    def _point_to_point(self, *tensors: torch.Tensor) -> bool:
        """Whether this collective runs as point-to-point transfers (gloo, contiguous CPU tensors)."""
        if not self.gloo_point_to_point or not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
            return False
        if self._cpu_backend_is_gloo is None:
            backend = str(dist.get_backend(self.group))  # "gloo", "nccl" or "cpu:gloo,cuda:nccl"
            self._cpu_backend_is_gloo = backend == "gloo" or "cpu:gloo" in backend
        return self._cpu_backend_is_gloo

    def _same_host(self) -> Optional[same_host.SameHostTransport]:
        """This group's same-host transport (set up at the group's first use: a collective), or None."""
        if not self.same_host_transport:
            return None
        group = self.group if self.group is not None else dist.group.WORLD
        entry = _SAME_HOST.get(id(group))
        if entry is None:
            try:
                transport = same_host.connect(_SetupExchange(self), self.rank, self.size, self.timeout_seconds)
            except CollectiveError:  # the exchange failed: it names the collective and the peers at fault already
                raise
            except (RuntimeError, OSError) as error:
                raise _failure("same-host transport setup", self.rank, self.size, error) from error
            entry = _SAME_HOST[id(group)] = (group, transport)
        return entry[1]

    def _shared(self, kind: str, transport, source: torch.Tensor, reads: dict,
                finish: Optional[Callable[[], None]], async_op: bool):
        number = blame.next_number(self._group_name())
        try:
            handle = _Named(transport.post(source, reads, finish, kind), kind, self.rank, self.size,
                            explain=lambda error: self._blamed(kind, number, error))
        except (RuntimeError, OSError) as error:
            raise self._blamed(kind, number, error) from error
        if async_op:
            return handle
        handle.wait()
        return None

    def _global(self, group_rank: int) -> int:
        if self._global_ranks is None:
            in_world = self.group is None or self.group == dist.group.WORLD
            self._global_ranks = [r if in_world else dist.get_global_rank(self.group, r) for r in range(self.size)]
        return self._global_ranks[group_rank]

    def _exchange(self, kind: str, sends: dict, receives: dict, finish: Optional[Callable[[], None]],
                  async_op: bool):
        """Post every receive, then every send (group rank -> tensor), under one fresh tag."""
        name = self._group_name()
        tag = _NEXT_TAG[name] = _NEXT_TAG[name] % (1 << 30) + 1
        works, waits = [], []
        try:
            for peer, tensor in receives.items():
                works.append(dist.irecv(tensor, src=self._global(peer), group=self.group, tag=tag))
                waits.append(f"a receive from global rank {self._global(peer)}")
            for peer, tensor in sends.items():
                works.append(dist.isend(tensor, dst=self._global(peer), group=self.group, tag=tag))
                waits.append(f"a send to global rank {self._global(peer)}")
        except RuntimeError as error:
            raise _failure(kind, self.rank, self.size, error) from error
        handle = _PointToPoint(works, finish, kind, self.rank, self.size, waits)
        if async_op:
            return handle
        handle.wait()
        return None

    def _reduce_scatter_p2p(self, output: torch.Tensor, input: torch.Tensor, async_op: bool):
        """Send chunk r of `input` to rank r, receive this rank's chunk from every peer, sum locally.

        With 2 ranks the peer's chunk lands in `output` itself and one in-place add finishes it."""
        numel, flat_out, flat_in = output.numel(), output.view(-1), input.view(-1)
        chunks = [flat_in[r * numel:(r + 1) * numel] for r in range(self.size)]
        peers = [r for r in range(self.size) if r != self.rank]
        own = chunks[self.rank]
        transport = self._same_host()
        if transport is not None:  # read this rank's chunk of every peer's input from its memory
            offset = self.rank * numel * input.element_size()
            if self.size == 2 and own.data_ptr() != flat_out.data_ptr():
                return self._shared("reduce_scatter", transport, flat_in, {peers[0]: (offset, flat_out, False)},
                                    lambda: flat_out.add_(own), async_op)
            if own.data_ptr() != flat_out.data_ptr():
                flat_out.copy_(own)
            return self._shared("reduce_scatter", transport, flat_in,
                                {peer: (offset, flat_out, True) for peer in peers}, None, async_op)
        if own.data_ptr() == flat_out.data_ptr() or self.size > 2:  # receive beside the output
            received = torch.empty((len(peers), numel), dtype=input.dtype)
        else:
            received = flat_out.view(1, numel)
        receives = {peer: received[i] for i, peer in enumerate(peers)}

        def finish() -> None:
            if received.data_ptr() == flat_out.data_ptr():
                flat_out.add_(own)
                return
            torch.add(own, received[0], out=flat_out)  # `own` may be `output` itself
            for row in received[1:]:
                flat_out.add_(row)
        return self._exchange("reduce_scatter", {peer: chunks[peer] for peer in peers}, receives, finish, async_op)

    def _all_gather_p2p(self, output: torch.Tensor, input: torch.Tensor, kind: str, async_op: bool):
        """Send `input` to every peer; receive every peer's chunk straight into `output`."""
        numel, flat_out = input.numel(), output.view(-1)
        chunks = [flat_out[r * numel:(r + 1) * numel] for r in range(self.size)]
        if input.data_ptr() != chunks[self.rank].data_ptr():
            chunks[self.rank].copy_(input.view(-1))
        peers = [r for r in range(self.size) if r != self.rank]
        send = input.view(-1)
        transport = self._same_host()
        if transport is not None:  # every peer reads `input` from this rank's memory
            return self._shared(kind, transport, send, {peer: (0, chunks[peer], False) for peer in peers},
                                None, async_op)
        return self._exchange(kind, {peer: send for peer in peers}, {peer: chunks[peer] for peer in peers},
                              None, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Sum `input` (size·len(output) elements) across ranks; this rank keeps chunk `rank` in `output`.

        `input` is only read, and must stay alive until the handle's wait() (which also finishes
        the local sum on gloo)."""
        if self.size == 1:
            output.copy_(input)
            return Completed() if async_op else None
        if input.numel() != self.size * output.numel():
            raise ValueError(f"reduce_scatter needs input of {self.size} x {output.numel()} elements, "
                             f"got {input.numel()}")
        self.counters.add("reduce_scatter", _nbytes(input) * self._ring_fraction())
        if self._point_to_point(output, input):
            return self._reduce_scatter_p2p(output, input, async_op)
        return self._call("reduce_scatter", _reduce_scatter_single, output, input, group=self.group,
                          async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, *,
                   kind: str = "all_gather", logical_bytes: Optional[float] = None):
        """Concatenate every rank's `input` into `output` (in-place when input is output's own chunk).

        `kind` names the counter (e.g. "all_gather_q8" for quantized weights); `logical_bytes`,
        when given, is what the uncompressed gather of the whole output would have sent.
        """
        if self.size == 1:
            if input.data_ptr() != output.data_ptr():
                output.copy_(input)
            return Completed() if async_op else None
        if output.numel() != self.size * input.numel():
            raise ValueError(f"{kind} needs output of {self.size} x {input.numel()} elements, got {output.numel()}")
        fraction = self._ring_fraction()
        self.counters.add(kind, _nbytes(output) * fraction,
                          None if logical_bytes is None else logical_bytes * fraction)
        if self._point_to_point(output, input) and output.dtype == input.dtype:
            return self._all_gather_p2p(output, input, kind, async_op)
        return self._call(kind, _all_gather_single, output, input, group=self.group, async_op=async_op)

    def all_gather_coalesced(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], async_op: bool = False, *,
                             kind: str = "all_gather"):
        """Several all-gathers as one collective: each `(output, input)` pair gets what `all_gather(output, input)`
        gives it. The inputs' bytes (any dtypes, on one device) are packed into one byte buffer, gathered once and
        unpacked into the outputs (after the handle's `wait()` when `async_op`); counted as one call of `kind`
        with the pairs' bytes. Outputs must be contiguous and of their input's dtype."""
        pairs = list(pairs)
        for output, input in pairs:
            if output.numel() != self.size * input.numel() or output.dtype != input.dtype:
                raise ValueError(f"{kind}: each output must hold {self.size} x its input's elements of its dtype, "
                                 f"got {output.numel()} {output.dtype} for {input.numel()} {input.dtype}")
        if self.size == 1 or len(pairs) == 1:  # nothing to pack
            handles = [self.all_gather(output, input, async_op, kind=kind) for output, input in pairs]
            return (handles[0] if handles else Completed()) if async_op else None
        sizes = [_nbytes(input) for _, input in pairs]
        total = sum(sizes)
        packed = torch.empty(self.size * total, dtype=torch.uint8, device=pairs[0][1].device)
        mine = packed[self.rank * total:(self.rank + 1) * total]
        offset = 0
        for (_, input), size in zip(pairs, sizes):
            mine[offset:offset + size].copy_(input.reshape(-1).view(torch.uint8))
            offset += size

        def unpack() -> None:
            rows, start = packed.view(self.size, total), 0
            for (output, _), size in zip(pairs, sizes):
                output.view(-1).view(torch.uint8).view(self.size, size).copy_(rows[:, start:start + size])
                start += size

        handle = _Then(self.all_gather(packed, mine, async_op=True, kind=kind), unpack)
        if async_op:
            return handle
        handle.wait()
        return None

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, *,
                   kind: str = "all_to_all", logical_bytes: Optional[float] = None):
        """Equal-split all-to-all: row r of `input` (size rows along dim 0) goes to rank r; row r of
        `output` comes from rank r. Counts the rows sent to other ranks; `logical_bytes` is the
        uncompressed size of the whole input (counted with the same (N-1)/N fraction)."""
        if input.shape[0] != self.size or output.shape != input.shape:
            raise ValueError(f"all_to_all needs input and output of {self.size} equal rows, got "
                             f"{tuple(input.shape)} and {tuple(output.shape)}")
        if self.size == 1:
            if input.data_ptr() != output.data_ptr():
                output.copy_(input)
            return Completed() if async_op else None
        fraction = self._ring_fraction()
        self.counters.add(kind, _nbytes(input) * fraction, None if logical_bytes is None else logical_bytes * fraction)
        return self._call(kind, dist.all_to_all_single, output, input, group=self.group, async_op=async_op)

    def gather_to(self, tensor: torch.Tensor, dst: int = 0) -> Optional[list[torch.Tensor]]:
        """Collect every rank's `tensor` (same shape everywhere) on `dst`; None elsewhere."""
        if self.size == 1:
            return [tensor]
        self.counters.add("gather", _nbytes(tensor) if self.rank != dst else 0)
        gathered = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == dst else None
        dst_global = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        self._call("gather", dist.gather, tensor, gathered, dst=dst_global, group=self.group)
        return gathered

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.size == 1:
            return
        self.counters.add("broadcast", _nbytes(tensor) if self.rank == src else 0)
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._call("broadcast", dist.broadcast, tensor, src=src_global, group=self.group)

    def any_true(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when `flag` is true on at least one (used for overflow agreement)."""
        value = torch.tensor([1.0 if flag else 0.0], device=device)
        self.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def min_ints(self, values: list[int], device: torch.device) -> list[int]:
        """The least of each value over the ranks (e.g. a memory budget every rank must share)."""
        tensor = torch.tensor(values, dtype=torch.int64, device=device)
        self.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return [int(v) for v in tensor.tolist()]

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a one-element tensor over ranks (e.g. squared gradient norms of the shards)."""
        self.all_reduce(value)
        return value

    # --- checkpoint I/O (used by zerotrain.checkpoint) --------------------------------------------
    def new_cpu_comm(self, timeout_seconds: Optional[float] = None) -> "Comm":
        """A Comm over the same ranks on a new gloo group, with its own counters.

        Checkpoint writers exchange host tensors and status through it, from a background
        thread while training keeps using this Comm. Collective: every rank of the default
        group must call it, in the same order as any other group creation.
        """
        if self.size == 1:
            return Comm(None, self.rank, 1, CommCounters(), timeout_seconds=self.timeout_seconds)
        ranks = None if self.group in (None, dist.group.WORLD) else dist.get_process_group_ranks(self.group)
        timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        return Comm(group, self.rank, self.size, CommCounters(), gloo_point_to_point=self.gloo_point_to_point,
                    same_host_transport=self.same_host_transport, timeout_seconds=self.timeout_seconds)

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order (small metadata only)."""
        if self.size == 1:
            return [obj]
        gathered: list = [None] * self.size
        self.counters.add("all_gather_object", 0)
        self._call("all_gather_object", _all_gather_object, gathered, obj, group=self.group)
        return gathered

    def all_to_all_bytes(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                         input_splits: list[int]) -> None:
        """Uneven all-to-all of 1-D uint8 tensors: chunk r of `input` goes to rank r (sizes by the splits)."""
        if self.size == 1:
            if output.numel():
                output.copy_(input)
            return
        self.counters.add("all_to_all", sum(input_splits) - input_splits[self.rank])
        self._call("all_to_all", dist.all_to_all_single, output, input, output_splits, input_splits,
                   group=self.group)


class ShapeOnlyComm(Comm):
    """A group of `size` ranks for a meta-device forward (`zerotrain estimate`'s activation measurement): this
    process is rank 0 and nothing moves (meta tensors hold no data; torch.distributed is not involved). The
    collectives a tensor-, sequence- or expert-parallel forward calls return at once; `largest_all_to_all_bytes`
    is the largest all-to-all's send buffer, whose send and receive buffers are the exchange's transient memory."""

    def __init__(self, size: int) -> None:
        super().__init__(None, 0, size)
        self.largest_all_to_all_bytes = 0

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, *,
                   kind: str = "all_to_all", logical_bytes: Optional[float] = None):
        """Nothing moved; the send buffer's bytes remembered when the largest so far."""
        self.largest_all_to_all_bytes = max(self.largest_all_to_all_bytes, _nbytes(input))
        return Completed() if async_op else None

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, *,
                   kind: str = "all_gather", logical_bytes: Optional[float] = None):
        """Nothing moved."""
        return Completed() if async_op else None

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False, *,
                   kind: str = "all_reduce"):
        """Nothing moved."""
        return Completed() if async_op else None


class _SetupExchange:
    """A Comm's group as the same-host transport's `SetupExchange`: its collectives through `Comm._call`, so a
    peer that never arrives at the setup is named (`comm.blame`) as at any collective; not counted (setting the
    transport up is not the job's traffic)."""

    KIND = "same-host transport setup"

    def __init__(self, comm: Comm):
        self._comm = comm

    def all_gather_object(self, obj) -> list:
        gathered: list = [None] * self._comm.size
        self._comm._call(self.KIND, _all_gather_object, gathered, obj, group=self._comm.group)
        return gathered

    def barrier(self) -> None:
        self._comm._call(self.KIND, dist.barrier, group=self._comm.group)
