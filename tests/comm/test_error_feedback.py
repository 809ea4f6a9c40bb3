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
