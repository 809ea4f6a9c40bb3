"""LoCo's error buffer (`comm.compressed.ErrorFeedback`), in process: e <- beta*e + (1-beta)*(c - deQ(Q(c))) kept in
8 bits, compensation, the exact rescale of the block scales, reset, and its checkpoint state."""
import pytest
import torch

from zerotrain.comm.compressed import ErrorFeedback


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # 8-bit blocks: within half a step of the block's absmax / 127
    torch.testing.assert_close(actual, expected, rtol=0, atol=float(expected.abs().max()) / 127)


def test_error_feedback_update_compensate_rescale_reset_and_state():
    torch.manual_seed(0)
    feedback = ErrorFeedback(2, 40, beta=0.75, block_size=16)
    grad = torch.randn(2, 40, dtype=torch.bfloat16)
    compensated, error = feedback.compensate(grad)
    assert error is None and feedback.error() is None and feedback.nbytes == 0
    assert compensated.dtype == torch.float32 and torch.equal(compensated, grad.float())
    feedback.rescale(2.0)  # nothing stored yet: nothing to rescale
    assert feedback.error() is None

    c1, d1 = torch.randn(2, 40), torch.randn(2, 40)
    feedback.update(c1, d1, None)
    first = feedback.error()
    _close(first, 0.25 * (c1 - d1))
    assert feedback.nbytes > 0

    compensated, error = feedback.compensate(grad)
    assert torch.equal(error, first) and torch.equal(compensated, grad.float() + first)
    c2, d2 = torch.randn(2, 40), torch.randn(2, 40)
    feedback.update(c2, d2, error)
    second = feedback.error()
    _close(second, 0.75 * first + 0.25 * (c2 - d2))

    feedback.rescale(0.5)  # exact: only the block scales change
    assert torch.equal(feedback.error(), second * 0.5)
    feedback.rescale(1.0)
    assert torch.equal(feedback.error(), second * 0.5)

    state = feedback.state_dict()
    restored = ErrorFeedback(2, 40, beta=0.75, block_size=16)
    restored.load_state_dict(state)
    assert torch.equal(restored.error(), feedback.error()) and restored.nbytes == feedback.nbytes
    with pytest.raises(ValueError, match="cannot load"):
        ErrorFeedback(4, 20, beta=0.75, block_size=16).load_state_dict(state)

    feedback.reset()
    assert feedback.error() is None and feedback.nbytes == 0
    empty = ErrorFeedback(2, 40, beta=0.75, block_size=16)
    restored.load_state_dict(empty.state_dict())  # a zero error saved: loads as zero
    assert restored.error() is None

    no_memory = ErrorFeedback(2, 40, beta=0.0, block_size=16)  # beta 0: only the newest residual
    no_memory.update(c1, d1, None)
    no_memory.update(c2, d2, no_memory.error())
    _close(no_memory.error(), c2 - d2)
    with pytest.raises(ValueError, match="err_beta"):
        ErrorFeedback(2, 40, beta=1.0)


def test_quantized_reduce_scatter_layout_one_and_two_hops():
    """The rows and columns of each hop (two hops only when both hierarchy levels have several ranks), the
    shape of each hop's LoCo buffer, and the bytes one call sends, from the layout alone (no collective runs)."""
    from zerotrain.comm import Comm
    from zerotrain.comm.compressed import QuantizedReduceScatter
    from zerotrain.comm.quant import row_wire_bytes

    S = 100
    two = QuantizedReduceScatter(Comm(None, 3, 4), S, bits=4, block_size=16, loco_beta=0.5,
                                 hierarchy=(Comm(None, 1, 2), Comm(None, 1, 2)))
    assert two.two_hop and [(hop.rows, hop.cols) for hop in two.hops] == [(2, 2 * S), (2, S)]
    assert [f.shape for f in two.feedbacks] == [(2, 2 * S), (2, S)]
    assert two.wire_bytes_per_call() == row_wire_bytes(2 * S, 4, 16) + row_wire_bytes(S, 4, 16)
    one = QuantizedReduceScatter(Comm(None, 3, 4), S, bits=4, block_size=16,
                                 hierarchy=(Comm(None, 0, 4), Comm(None, 0, 1)))  # one node: one hop
    assert not one.two_hop and [(hop.rows, hop.cols) for hop in one.hops] == [(4, S)] and one.feedbacks == []
    assert one.wire_bytes_per_call() == 3 * row_wire_bytes(S, 4, 16)
    with pytest.raises(ValueError, match="two-hop reduce"):
        QuantizedReduceScatter(Comm(None, 0, 4), S, hierarchy=(Comm(None, 0, 2), Comm(None, 0, 3)))
