"""ZeRO++ collectives: quantized gradient reduce-scatter (qgZ) with LoCo, quantized weight all-gather (qwZ).

qgZ. A reduce-scatter of a rank-major buffer (N chunks of S elements; rank r owns chunk r)
becomes: quantize every chunk (int4 by default, blocks never straddle chunks), one
all-to-all of the packed bytes and their scales (chunk r goes to rank r), dequantize what
arrived and sum it in fp32 — the owner's shard. Unlike a ring reduce-scatter nothing is
re-quantized along the way, so the error is one quantization per contribution.

Two hops when the ranks span several nodes of L ranks (M = N/L nodes, rank n·L + l is
local index l of node n):

1. intra-node, over the L ranks of a node: local index l receives, from every node-mate,
   the M chunks owned by local index l of every node (n'·L + l for n' = 0..M-1), and sums
   them: partial sums over the node, 1/L of the buffer;
2. inter-node, over the M ranks with the same local index: chunk n'·L + l of the partial
   sums goes to node n'; the sum of what arrives is this rank's shard.

The inter-node hop then carries 1/L of what a one-hop exchange would send across nodes.
Each hop quantizes what it sends; with LoCo each hop has its own error buffer.

LoCo (Xie et al. 2024) error feedback, per compressed buffer: compress c = g + e instead of
g, then e ← β·e + (1 − β)·(c − deQ(Q(c))). Summed over steps the compressed gradients differ
from the true ones by (e₀ − e_T)/(1 − β): bounded, where plain quantization's error keeps
adding up. e is stored in 8 bits (int8, one fp32 scale per block), so it costs a quarter
of an fp32 gradient. Its owner (`zero.reduce.QuantizedReduce`, told of each optimizer step
by the engine through the gradient reducer) resets it every `reset_T` optimizer steps, drops
it after an fp16 overflow and rescales it when the loss scale changes.

Non-finite gradients (an fp16 overflow) are never packed as numbers: a buffer holding inf or
nan is sent as blocks whose scales are nan, so every owner's shard becomes nan, the
engine's overflow check sees it and skips the step — all ranks still take part in the
all-to-all, so nobody hangs.

qwZ. A stage-3 parameter all-gather sends each rank's shard as int8 blocks plus scales
(one collective for a whole bucket of parameters) and dequantizes on arrival into the
full parameter buffer; every rank gets the same dequantized values.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .core import Comm
from .quant import DEFAULT_BLOCK, QuantizedRows, quantize_rows, row_wire_bytes

__all__ = ["ErrorFeedback", "QuantizedReduceScatter", "QuantizedAllGather", "Float8AllGather"]


class ErrorFeedback:
    """LoCo's error buffer for one compressed (rows, cols) tensor, stored in 8 bits."""

    def __init__(self, rows: int, cols: int, beta: float, block_size: int = DEFAULT_BLOCK):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"LoCo err_beta must be in [0, 1), got {beta}")
        self.shape = (rows, cols)
        self.beta = float(beta)
        self.block_size = block_size
        self.stored: Optional[QuantizedRows] = None  # None: e = 0

    def error(self) -> Optional[torch.Tensor]:
        """e in fp32 (rows, cols), or None while it is zero."""
        return None if self.stored is None else self.stored.dequantize()

    def compensate(self, grad: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(c = g + e in fp32, e) — `grad` is not modified."""
        error = self.error()
        compensated = grad.to(torch.float32) if error is None else grad.to(torch.float32) + error
        return compensated, error

    def update(self, compensated: torch.Tensor, decompressed: torch.Tensor, error: Optional[torch.Tensor]) -> None:
        """e ← β·e + (1 − β)·(c − deQ(Q(c))), stored again in 8 bits."""
        new = (compensated - decompressed).mul_(1.0 - self.beta)
        if error is not None and self.beta:
            new.add_(error, alpha=self.beta)
        self.stored = quantize_rows(new, 8, self.block_size, check_finite=False)

    def reset(self) -> None:
        self.stored = None

    def rescale(self, factor: float) -> None:
        """Multiply e by `factor` (exactly: only the block scales change)."""
        if self.stored is not None and factor != 1.0:
            self.stored.scales.mul_(factor)

    @property
    def nbytes(self) -> int:
        return 0 if self.stored is None else self.stored.nbytes

    def state_dict(self) -> dict:
        state = {"shape": list(self.shape), "beta": self.beta}
        if self.stored is not None:
            state["stored"] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                               for k, v in self.stored.to_state().items()}
        return state

    def load_state_dict(self, state: dict, device: Optional[torch.device] = None) -> None:
        if tuple(state["shape"]) != self.shape:
            raise ValueError(f"LoCo error buffer of shape {tuple(state['shape'])} cannot load into {self.shape}")
        stored = state.get("stored")
        if stored is None:
            self.stored = None
            return
        moved = {k: (v.to(device) if torch.is_tensor(v) and device is not None else v) for k, v in stored.items()}
        self.stored = QuantizedRows.from_state(moved)


class _Hop:
    def __init__(self, comm: Comm, rows: int, cols: int, kind: str, feedback: Optional[ErrorFeedback]):
        self.comm, self.rows, self.cols, self.kind, self.feedback = comm, rows, cols, kind, feedback


class _PendingReduce:
    """Handle of a quantized reduce-scatter in flight; wait() finishes it into `output`."""

    def __init__(self, owner: "QuantizedReduceScatter", output: torch.Tensor, first: tuple, logical_elem: int):
        self._owner, self._output, self._first, self._logical_elem = owner, output, first, logical_elem
        self._done = False

    def wait(self) -> bool:
        if self._done:
            return True
        owner = self._owner
        partial = owner._finish(owner.hops[0], *self._first)
        if len(owner.hops) == 2:
            hop = owner.hops[1]
            handle, received = owner._launch(hop, partial.view(hop.rows, hop.cols), self._logical_elem)
            partial = owner._finish(hop, handle, received)
        self._output.copy_(partial[:self._output.numel()])
        self._done = True
        return True


class QuantizedReduceScatter:
    """qgZ for one buffer layout (N chunks of `shard_numel`), with optional LoCo feedback per hop.

    `hierarchy` = (intra-node Comm, inter-node Comm) over the same ranks as `comm`, whose
    sizes L·M = N; with it (and L, M > 1) the reduce takes two hops, otherwise one.
    """

    def __init__(self, comm: Comm, shard_numel: int, bits: int = 4, block_size: int = DEFAULT_BLOCK,
                 loco_beta: Optional[float] = None, hierarchy: Optional[tuple[Comm, Comm]] = None,
                 error_block_size: int = DEFAULT_BLOCK):
        self.comm = comm
        self.shard_numel = shard_numel
        self.bits = bits
        self.block_size = block_size
        self.kind = f"reduce_scatter_q{bits}"
        size, S = comm.size, shard_numel

        def feedback(rows: int, cols: int) -> Optional[ErrorFeedback]:
            return None if loco_beta is None else ErrorFeedback(rows, cols, loco_beta, error_block_size)

        if hierarchy is not None and hierarchy[0].size > 1 and hierarchy[1].size > 1:
            intra, inter = hierarchy
            if intra.size * inter.size != size:
                raise ValueError(f"two-hop reduce: {intra.size} ranks per node × {inter.size} nodes != {size} ranks")
            L, M = intra.size, inter.size
            self.hops = [_Hop(intra, L, M * S, self.kind + "_intra", feedback(L, M * S)),
                         _Hop(inter, M, S, self.kind + "_inter", feedback(M, S))]
        else:
            self.hops = [_Hop(comm, size, S, self.kind, feedback(size, S))]

    @property
    def two_hop(self) -> bool:
        return len(self.hops) == 2

    @property
    def feedbacks(self) -> list[ErrorFeedback]:
        return [hop.feedback for hop in self.hops if hop.feedback is not None]

    def __call__(self, source: torch.Tensor, output: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, _PendingReduce]:
        """Start reducing `source` (N·S elements, rank-major); returns (output, handle): after
        handle.wait(), `output` (fp32, S elements) holds this rank's summed chunk."""
        N, S = self.comm.size, self.shard_numel
        if source.numel() != N * S:
            raise ValueError(f"quantized reduce-scatter expects {N}×{S} elements, got {source.numel()}")
        if output is None:
            output = torch.empty(S, dtype=torch.float32, device=source.device)
        chunks = source.reshape(N, S)
        first = self.hops[0]
        if self.two_hop:  # rows for local index l: the chunks of local index l in every node
            M, L = self.hops[1].rows, first.rows
            chunks = chunks.view(M, L, S).transpose(0, 1).reshape(L, M * S)
        pending = self._launch(first, chunks, source.element_size())
        return output, _PendingReduce(self, output, pending, source.element_size())

    # --- one hop ---------------------------------------------------------------
    def _launch(self, hop: _Hop, rows: torch.Tensor, logical_elem: int):
        if hop.feedback is not None:
            compensated, error = hop.feedback.compensate(rows)
        else:
            compensated, error = rows, None
        if bool(torch.isfinite(compensated).all()):
            quantized = quantize_rows(compensated, self.bits, self.block_size, check_finite=False)
            if hop.feedback is not None:
                hop.feedback.update(compensated, quantized.dequantize(), error)
        else:  # an overflow: send nan scales so the owners see it (the engine drops e on the overflow)
            quantized = quantize_rows(torch.zeros(rows.shape, dtype=torch.float32, device=rows.device),
                                      self.bits, self.block_size, check_finite=False)
            quantized.scales.fill_(float("nan"))
        send = quantized.wire()
        received = torch.empty_like(send)
        handle = hop.comm.all_to_all(received, send, async_op=True, kind=hop.kind,
                                     logical_bytes=hop.rows * hop.cols * logical_elem)
        return handle, received

    def _finish(self, hop: _Hop, handle, received: torch.Tensor) -> torch.Tensor:
        handle.wait()
        parts = QuantizedRows.from_wire(received, hop.cols, self.bits, self.block_size).dequantize()
        return parts.sum(dim=0)

    # --- LoCo control --------------------------------------------------------------
    def reset_error(self) -> None:
        for feedback in self.feedbacks:
            feedback.reset()

    def rescale_error(self, factor: float) -> None:
        for feedback in self.feedbacks:
            feedback.rescale(factor)

    def wire_bytes_per_call(self) -> int:
        """Bytes this rank sends per reduce (all hops), from the layout alone."""
        total = 0
        for hop in self.hops:
            total += (hop.rows - 1) * row_wire_bytes(hop.cols, self.bits, self.block_size)
        return total


class _PendingGather:
    def __init__(self, handle, finish):
        self._handle, self._finish, self.result = handle, finish, None

    def wait(self) -> bool:
        if self.result is None:
            self._handle.wait()
            self.result = self._finish()
        return True


def _gather_wire(comm: Comm, kind: str, shards: Sequence[torch.Tensor], pieces: list[torch.Tensor],
                 dtype: Optional[torch.dtype],
                 decode: Callable[[int, torch.Tensor, int, torch.dtype], torch.Tensor]) -> _PendingGather:
    """Start one all-gather of the shards' encoded bytes (`pieces`, one uint8 row per shard, equal widths on every
    rank); after wait(), `.result` holds each shard's full flat tensor, `decode(index, bytes by rank, numel,
    dtype)` of its columns. What the quantized gathers share; they differ in the encoding only."""
    N = comm.size
    widths = [piece.numel() for piece in pieces]
    send = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    received = torch.empty(N * send.numel(), dtype=torch.uint8, device=send.device)
    logical = sum(s.numel() * s.element_size() for s in shards) * N
    handle = comm.all_gather(received, send, async_op=True, kind=kind, logical_bytes=logical)
    numels = [s.numel() for s in shards]
    dtypes = [dtype or s.dtype for s in shards]

    def finish() -> list[torch.Tensor]:
        by_rank = received.view(N, -1)
        out, offset = [], 0
        for index, (numel, width, out_dtype) in enumerate(zip(numels, widths, dtypes)):
            out.append(decode(index, by_rank[:, offset:offset + width], numel, out_dtype))
            offset += width
        return out

    return _PendingGather(handle, finish)


E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


class Float8AllGather:
    """fp8 weight gathers at ZeRO-3 (FSDP2's `enable_fsdp_float8_all_gather`, here for flat shards): each
    tensor's scale is tensorwise over the whole tensor (the MAX all-reduce of every shard's amax), each shard
    travels as float8 e4m3 (1 byte per element) and arrives dequantized (value / scale) in `dtype`. A float8
    layer casting the arrived weight again with its own tensorwise scale gets the same float8 values (the
    largest element maps to the e4m3 maximum both times), so its matmuls are those of a full high-precision
    gather; only the bytes on the wire change: 1 per element plus the 4-byte amax.

    Scales: `scales(shards)` computes them for many tensors in one all-reduce (torchao's
    `precompute_float8_dynamic_scale_for_fsdp`: the stage-3 fetcher calls it once per micro-step for every
    float8 weight and passes each gather its own); a gather given none computes its own.

    Memory: the received float8 bytes and the dequantized whole in `dtype` (the parameter the layer reads),
    plus one shard-sized fp32 temporary at a time; no whole-sized fp32 copies beside them. What torchao lacks
    for us: its float8 gather hands FSDP2 a `Float8TrainingTensor` (`fsdp_post_all_gather`), so the layer never
    sees a high-precision whole; that protocol is FSDP2's DTensor extension, which ZeRO-3's flat partitions are
    not, so here the whole is dequantized into the training dtype (the size of a plain gather's output)."""

    kind = "all_gather_fp8"
    amax_kind = "all_reduce_fp8_amax"

    def __init__(self, comm: Comm):
        self.comm = comm

    def scales(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The e4m3 scale of each whole tensor (fp32, one per shard's tensor): one MAX all-reduce of every
        shard's amax over the group, for all of them at once."""
        amax = torch.stack([shard.detach().abs().max().float() if shard.numel() else
                            torch.zeros((), device=shard.device) for shard in shards])
        self.comm.all_reduce(amax, op=dist.ReduceOp.MAX, kind=self.amax_kind)
        return E4M3_MAX / amax.clamp(min=1e-12)  # torchao's amax_to_scale (fp32; EPS 1e-12)

    def __call__(self, shards: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None,
                 scales: Optional[torch.Tensor] = None) -> _PendingGather:
        """Start gathering (with `scales`, one per shard, from `scales()`; else computed here); after wait(),
        `.result` is a list of full flat tensors (N·numel of each shard, rank-major) in `dtype` (default: the
        shards' dtype)."""
        if scales is None:
            scales = self.scales(shards)
        pieces = [(shard.detach().float() * scales[i]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
                  .view(torch.uint8).reshape(-1) for i, shard in enumerate(shards)]

        def decode(index: int, columns: torch.Tensor, numel: int, out_dtype: torch.dtype) -> torch.Tensor:
            out = torch.empty(columns.shape[0], numel, dtype=out_dtype, device=columns.device)
            for rank, row in enumerate(columns):  # one shard-sized fp32 temporary at a time
                out[rank].copy_(row.view(torch.float8_e4m3fn).float().div_(scales[index]))
            return out.reshape(-1)

        return _gather_wire(self.comm, self.kind, shards, pieces, dtype, decode)


class QuantizedAllGather:
    """qwZ: gather equal-size shards of several tensors as int8 blocks + scales in one collective."""

    def __init__(self, comm: Comm, bits: int = 8, block_size: int = DEFAULT_BLOCK):
        self.comm = comm
        self.bits = bits
        self.block_size = block_size
        self.kind = f"all_gather_q{bits}"

    def __call__(self, shards: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None) -> _PendingGather:
        """Start gathering; after wait(), `.result` is a list of full flat tensors (N·numel of each
        shard, rank-major) in `dtype` (default: the shards' dtype)."""
        pieces = []
        for shard in shards:
            row = shard.reshape(1, -1)
            if bool(torch.isfinite(row).all()):
                quantized = quantize_rows(row, self.bits, self.block_size, check_finite=False)
            else:  # diverged weights stay visibly non-finite on every rank
                quantized = quantize_rows(torch.zeros_like(row, dtype=torch.float32), self.bits, self.block_size,
                                          check_finite=False)
                quantized.scales.fill_(float("nan"))
            pieces.append(quantized.wire().reshape(-1))

        def decode(index: int, columns: torch.Tensor, numel: int, out_dtype: torch.dtype) -> torch.Tensor:
            rows = QuantizedRows.from_wire(columns, numel, self.bits, self.block_size)
            return rows.dequantize(out_dtype).reshape(-1)

        return _gather_wire(self.comm, self.kind, shards, pieces, dtype, decode)
