"""Blockwise symmetric quantization to int8, or to int4 packed two per byte, with torch ops.

A tensor is quantized row by row (a 1-D tensor is one row). Each row is cut into blocks of
`block` consecutive elements (the last one zero-padded); each block gets one scale
s = max|x| / qmax (qmax = 127 for int8, 7 for int4) and each element the integer
q = round(x / s) in [-qmax, qmax]. Dequantizing gives q·s, so every element is off by at
most s/2: half a quantization step. An all-zero block has scale 0 and dequantizes to zeros
(never nan). Blocks never straddle rows, so the rows of a rank-major buffer can be sent to
different ranks as they are.

int4 values are stored offset by 8 (1..15) in nibbles, two per byte, the even element in
the low nibble. Scales are fp32 by default; fp16 scales are rounded up so the half-step
bound still holds.

Rows shorter than the block size use a block of the row's length (rounded up to even), so
quantizing a small tensor never sends more padding than data.

Every function runs on whatever device its input is on (CPU or CUDA); the whole
quantization is a handful of vectorized torch ops, no Python loop over blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["QuantizedRows", "NonFiniteError", "quantize", "quantize_rows", "dequantize", "effective_block",
           "row_wire_bytes", "QMAX", "DEFAULT_BLOCK"]

QMAX = {8: 127, 4: 7}
DEFAULT_BLOCK = 256


class NonFiniteError(ValueError):
    """The tensor to quantize holds inf or nan: there is no scale that represents it."""


def effective_block(cols: int, block_size: int) -> int:
    """The block size used for rows of `cols` elements: `block_size`, or the row length (even) if shorter."""
    if block_size < 2 or block_size % 2:
        raise ValueError(f"block size must be an even number >= 2, got {block_size}")
    return max(2, min(block_size, cols + (cols % 2)))


def _check_bits(bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"quantization supports 8 or 4 bits, got {bits}")


def row_wire_bytes(cols: int, bits: int, block_size: int = DEFAULT_BLOCK,
                   scale_dtype: torch.dtype = torch.float32) -> int:
    """Bytes one quantized row of `cols` elements takes on the wire (data plus scales)."""
    _check_bits(bits)
    block = effective_block(cols, block_size)
    blocks = -(-cols // block)
    return blocks * block * bits // 8 + blocks * torch.empty((), dtype=scale_dtype).element_size()


@dataclass
class QuantizedRows:
    """`rows` rows of `cols` values, quantized: `data` (int8, or uint8 with two int4 per byte) and
    `scales` (one per block, shape (rows, blocks))."""

    data: torch.Tensor
    scales: torch.Tensor
    cols: int
    bits: int
    block: int

    @property
    def rows(self) -> int:
        return self.scales.shape[0]

    @property
    def blocks(self) -> int:
        return self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def integers(self) -> torch.Tensor:
        """The signed integers q, (rows, blocks·block), as int8."""
        if self.bits == 8:
            return self.data
        low = (self.data & 0x0F).to(torch.int8)
        high = (self.data >> 4).to(torch.int8)
        return torch.stack((low, high), dim=-1).reshape(self.rows, -1) - 8

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values q·s, (rows, cols)."""
        values = self.integers().to(torch.float32).view(self.rows, self.blocks, self.block)
        values = (values * self.scales.to(torch.float32).unsqueeze(-1)).view(self.rows, -1)
        values = values[:, :self.cols]
        return values if dtype == torch.float32 else values.to(dtype)

    def wire(self) -> torch.Tensor:
        """One uint8 buffer (rows, data bytes + scale bytes): what a collective sends."""
        return torch.cat((self.data.view(torch.uint8), self.scales.contiguous().view(torch.uint8)), dim=1)

    @classmethod
    def from_wire(cls, buffer: torch.Tensor, cols: int, bits: int, block_size: int = DEFAULT_BLOCK,
                  scale_dtype: torch.dtype = torch.float32) -> "QuantizedRows":
        """Read back rows written by `wire()` (the same cols, bits, block size and scale dtype)."""
        _check_bits(bits)
        block = effective_block(cols, block_size)
        blocks = -(-cols // block)
        data_bytes = blocks * block * bits // 8
        if buffer.dim() != 2 or buffer.shape[1] != row_wire_bytes(cols, bits, block_size, scale_dtype):
            raise ValueError(f"wire buffer of shape {tuple(buffer.shape)} does not hold rows of {cols} values "
                             f"at {bits} bits, block {block}")
        data = buffer[:, :data_bytes]
        if bits == 8:
            data = data.contiguous().view(torch.int8)
        tail = buffer[:, data_bytes:]
        scales = torch.empty(tail.shape, dtype=torch.uint8, device=tail.device).copy_(tail).view(scale_dtype)
        return cls(data=data, scales=scales, cols=cols, bits=bits, block=block)

    def to_state(self) -> dict:
        """Plain tensors and ints (for a checkpoint)."""
        return {"data": self.data, "scales": self.scales, "cols": self.cols, "bits": self.bits, "block": self.block}

    @classmethod
    def from_state(cls, state: dict) -> "QuantizedRows":
        return cls(data=state["data"], scales=state["scales"], cols=int(state["cols"]), bits=int(state["bits"]),
                   block=int(state["block"]))


def _round_scales(scales: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Scales in `scale_dtype`, never smaller than the exact fp32 ones (so |x|/s <= qmax still holds)."""
    if scale_dtype == torch.float32:
        return scales
    if scale_dtype != torch.float16:
        raise ValueError(f"scales are float32 or float16, got {scale_dtype}")
    rounded = scales.to(torch.float16)
    if not bool(torch.isfinite(rounded).all()):
        raise NonFiniteError("a block's scale exceeds the float16 range; use float32 scales")
    low = rounded.to(torch.float32) < scales
    return torch.where(low, torch.nextafter(rounded, torch.full_like(rounded, float("inf"))), rounded)


def quantize_rows(x: torch.Tensor, bits: int, block_size: int = DEFAULT_BLOCK,
                  scale_dtype: torch.dtype = torch.float32, check_finite: bool = True) -> QuantizedRows:
    """Quantize a 2-D tensor row by row (blocks never straddle rows).

    Raises :class:`NonFiniteError` when `x` holds inf or nan (one `isfinite().all()` per call;
    `check_finite=False` skips it for callers that have already checked).
    """
    _check_bits(bits)
    if x.dim() != 2:
        raise ValueError(f"quantize_rows needs a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"quantize needs a floating-point tensor, got {x.dtype}")
    rows, cols = x.shape
    block = effective_block(cols, block_size)
    if check_finite and x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteError(f"cannot quantize a tensor holding inf or nan ({bad} of {x.numel()} elements); "
                             "a scale cannot represent them")
    blocks = -(-cols // block)
    values = x.to(torch.float32)
    if blocks * block != cols:
        values = F.pad(values, (0, blocks * block - cols))
    values = values.reshape(rows, blocks, block)
    qmax = QMAX[bits]
    # Divided by a tensor, not a Python number: CUDA computes `tensor / number` as tensor * (1 / number), which
    # rounds twice and can differ from the CPU's correctly rounded division in the last bit (then the integers too).
    amax = values.abs().amax(dim=2) if blocks else values.new_zeros(rows, 0)
    scales = _round_scales(amax / torch.full((), float(qmax), device=amax.device), scale_dtype)
    divisor = scales.to(torch.float32)
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor)).unsqueeze(-1)
    integers = torch.round(values / divisor).clamp_(-qmax, qmax).to(torch.int8).view(rows, blocks * block)
    if bits == 8:
        data = integers
    else:
        offset = (integers + 8).to(torch.uint8)
        data = offset[:, 0::2] | (offset[:, 1::2] << 4)
    return QuantizedRows(data=data, scales=scales, cols=cols, bits=bits, block=block)


def quantize(x: torch.Tensor, bits: int, block_size: int = DEFAULT_BLOCK,
             scale_dtype: torch.dtype = torch.float32) -> QuantizedRows:
    """Quantize any tensor as one flat row (see `quantize_rows`)."""
    return quantize_rows(x.reshape(1, -1), bits, block_size, scale_dtype)


def dequantize(q: QuantizedRows, shape=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize; with `shape`, reshape the (single-row or all-rows) result to it."""
    values = q.dequantize(dtype)
    return values.reshape(shape) if shape is not None else values
