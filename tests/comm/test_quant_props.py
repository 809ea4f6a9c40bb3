"""Blockwise int8/int4 quantization: property-based round trips (hypothesis) and the edge cases."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerotrain.comm.quant import (QMAX, NonFiniteError, QuantizedRows, dequantize, effective_block, quantize,
                                  quantize_rows, row_wire_bytes)

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)


@st.composite
def tensors(draw):
    """A (rows, cols) float32 tensor with assorted magnitudes, exact zeros and whole zero blocks."""
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(1, 700))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1e-30, 1e-6, 1.0, 1e3, 1e30]))
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=generator) * magnitude
    if draw(st.booleans()):  # sprinkle exact zeros
        values[torch.rand(rows, cols, generator=generator) < 0.3] = 0.0
    if draw(st.booleans()) and cols > 8:  # a whole run of zeros (covers all-zero blocks)
        start = draw(st.integers(0, cols - 1))
        values[:, start:start + draw(st.integers(1, cols))] = 0.0
    if draw(st.booleans()):  # some outliers in one block
        values[0, draw(st.integers(0, cols - 1))] = magnitude * 50
    return values


def _half_steps(q: QuantizedRows) -> torch.Tensor:
    """Half a quantization step of every element: scale/2 of its block, (rows, cols)."""
    return (q.scales.float() / 2).repeat_interleave(q.block, dim=1)[:, :q.cols]


def _assert_within_half_step(x: torch.Tensor, q: QuantizedRows) -> None:
    restored = q.dequantize()
    assert restored.shape == x.shape
    assert torch.isfinite(restored).all()
    error = (restored - x).abs()
    # Half a step, plus float32 rounding of x/s and q·s (a few ulps of |x|).
    bound = _half_steps(q) * (1 + 1e-6) + x.abs() * 4 * torch.finfo(torch.float32).eps
    worst = (error - bound).max().item()
    assert worst <= 0, f"error exceeds half a step by {worst}"


@SETTINGS
@given(tensors(), st.sampled_from([4, 8]), st.sampled_from([2, 8, 32, 64, 100, 256, 512]))
def test_round_trip_within_half_step(x, bits, block_size):
    q = quantize_rows(x, bits, block_size)
    _assert_within_half_step(x, q)
    integers = q.integers()
    assert integers.abs().max().item() <= QMAX[bits]
    assert q.block == effective_block(x.shape[1], block_size)
    # An all-zero block has scale 0 and comes back as zeros, never nan.
    blocks = torch.nn.functional.pad(x, (0, q.blocks * q.block - x.shape[1])).view(x.shape[0], q.blocks, q.block)
    zero_blocks = (blocks == 0).all(dim=2)
    assert (q.scales[zero_blocks] == 0).all()


@SETTINGS
@given(tensors(), st.sampled_from([4, 8]))
def test_fp16_scales_keep_the_bound(x, bits):
    x = x.clamp(-1e4, 1e4)  # scales must fit float16
    q = quantize_rows(x, bits, 64, scale_dtype=torch.float16)
    assert q.scales.dtype == torch.float16
    _assert_within_half_step(x, q)


@SETTINGS
@given(tensors(), st.sampled_from([4, 8]), st.sampled_from([16, 256]))
def test_wire_round_trip_and_size(x, bits, block_size):
    q = quantize_rows(x, bits, block_size)
    wire = q.wire()
    assert wire.dtype == torch.uint8
    assert wire.shape == (x.shape[0], row_wire_bytes(x.shape[1], bits, block_size))
    back = QuantizedRows.from_wire(wire, x.shape[1], bits, block_size)
    assert torch.equal(back.dequantize(), q.dequantize())


@SETTINGS
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=300),
       st.sampled_from([4, 8]))
def test_any_shape_flattens(values, bits):
    x = torch.tensor(values, dtype=torch.float32)
    shaped = x.reshape(-1, 1) if len(values) % 2 else x.reshape(1, -1)
    q = quantize(shaped, bits, 32)
    _assert_within_half_step(x.reshape(1, -1), q)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("bits", [4, 8])
def test_non_finite_input_is_reported(bad, bits):
    x = torch.randn(3, 100)
    x[1, 57] = bad
    with pytest.raises(NonFiniteError, match="inf or nan"):
        quantize_rows(x, bits)


def test_all_zero_and_tiny_inputs():
    for bits in (4, 8):
        q = quantize(torch.zeros(1000), bits)
        assert torch.equal(q.dequantize(), torch.zeros(1, 1000))
        assert (q.scales == 0).all()
        # Shorter than a block: the block shrinks to the (even) row length.
        q = quantize(torch.tensor([1.0, -2.0, 3.0]), bits, 256)
        assert q.block == 4 and q.blocks == 1
        _assert_within_half_step(torch.tensor([[1.0, -2.0, 3.0]]), q)


def test_packing_and_exact_values():
    # Multiples of the step come back exactly; int4 packs two values per byte.
    x = torch.tensor([[-7.0, -3.0, 0.0, 1.0, 5.0, 7.0, 2.0, -1.0]])
    q = quantize_rows(x, 4, 8)
    assert q.data.dtype == torch.uint8 and q.data.numel() == 4
    assert torch.equal(q.dequantize(), x)
    assert q.scales.item() == 1.0
    q8 = quantize_rows(x * (127 / 7), 8, 8)
    assert q8.data.dtype == torch.int8 and q8.data.numel() == 8


def test_bytes_are_an_eighth_of_fp32_plus_scales():
    cols, block = 1 << 16, 256
    assert row_wire_bytes(cols, 4, block) == cols // 2 + 4 * cols // block
    ratio = row_wire_bytes(cols, 4, block) / (4 * cols)
    assert math.isclose(ratio, 1 / 8 + 1 / 256)
    assert row_wire_bytes(cols, 8, block) == cols + 4 * cols // block


def test_bad_arguments():
    with pytest.raises(ValueError, match="8 or 4 bits"):
        quantize(torch.ones(4), 3)
    with pytest.raises(ValueError, match="even"):
        quantize(torch.ones(4), 4, 7)
    with pytest.raises(TypeError):
        quantize(torch.ones(4, dtype=torch.int32), 4)


def test_sizes_state_and_a_bad_wire_buffer():
    # nbytes is what goes on the wire (data and scales); a buffer of another width is refused, not misread.
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    for bits in (4, 8):
        q = quantize_rows(x, bits, 32)
        wire = q.wire()
        assert q.nbytes == wire.numel() == 3 * row_wire_bytes(100, bits, 32)
        with pytest.raises(ValueError, match="does not hold rows of 100 values"):
            QuantizedRows.from_wire(wire[:, :-1], 100, bits, 32)
        back = QuantizedRows.from_state(q.to_state())  # LoCo's error feedback is checkpointed so
        assert torch.equal(back.dequantize(), q.dequantize()) and back.nbytes == q.nbytes
    with pytest.raises(ValueError, match="8 or 4 bits"):
        row_wire_bytes(100, 3)
    # The module-level dequantize: reshaped to the caller's shape, in the caller's dtype.
    q = quantize(x, 8, 32)
    assert torch.equal(dequantize(q, shape=(3, 100)), q.dequantize().reshape(3, 100))
    assert dequantize(q, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(NonFiniteError, match="float16 range"):
        quantize(torch.tensor([1e7, 1.0]), 8, scale_dtype=torch.float16)
    with pytest.raises(ValueError, match="float32 or float16"):
        quantize(torch.ones(4), 8, scale_dtype=torch.bfloat16)
