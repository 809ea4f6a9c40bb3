"""The built-in GPT: shapes, loss, causality, determinism, weight tying, presets."""
import math

import pytest
import torch

from zerotrain.models import GPT, PRESETS, GPTConfig


def _tiny(**overrides):
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", **overrides))


def test_forward_shapes_and_initial_loss():
    model = _tiny()
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx)
    assert logits.shape == (3, 16, 256)
    assert loss is None
    _, loss = model(idx, torch.randint(0, 256, (3, 16)))
    assert loss.dim() == 0
    # Near-uniform predictions at init: loss close to ln(vocab).
    assert abs(loss.item() - math.log(256)) < 0.5


def test_loss_is_mean_token_cross_entropy():
    model = _tiny()
    idx, targets = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    logits, loss = model(idx, targets)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_attention_is_causal():
    model = _tiny().eval()
    idx = torch.randint(0, 256, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_init_is_deterministic_under_seed():
    a, b = _tiny(), _tiny()
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb
        assert torch.equal(pa, pb), na
    torch.manual_seed(1)
    c = GPT(GPTConfig.preset("tiny"))
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)


def test_weights_tied_by_default_and_untied_on_request():
    tied = _tiny()
    assert tied.lm_head.weight is tied.transformer.wte.weight
    untied = _tiny(tie_weights=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    extra = 256 * untied.config.n_embd
    assert untied.num_parameters() == tied.num_parameters() + extra


def test_tiny_preset_needs_padding_to_shard():
    model = _tiny()
    total = model.num_parameters()
    assert total % 2 == 1
    assert 50_000 <= total <= 200_000
    assert any(p.numel() % 2 == 1 for p in model.parameters())


@pytest.mark.parametrize("name, low, high", [("small", 5e6, 10e6), ("70m", 65e6, 75e6)])
def test_preset_sizes(name, low, high):
    # Count from the config on the meta device: no memory, no init time.
    with torch.device("meta"):
        model = GPT(GPTConfig.preset(name))
    assert low <= model.num_parameters() <= high


def test_gradients_reach_every_parameter_and_loss_drops():
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 256, (4, 16))
    targets = torch.roll(idx, -1, dims=1)
    _, first = model(idx, targets)
    first.backward()
    assert all(p.grad is not None for p in model.parameters())
    for _ in range(20):
        opt.step()
        opt.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
    assert loss.item() < first.item() * 0.8


def test_config_validation_and_unknown_preset():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="unknown GPT preset"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match="block_size"):
        _tiny()(torch.zeros(1, 33, dtype=torch.long))
    assert set(PRESETS) >= {"tiny", "small", "70m"}


def _loss_and_grads(model, idx, targets):
    logits, loss = model(idx, targets)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return logits.detach(), loss.detach(), grads


def test_checkpointed_and_sequence_parallel_forwards_equal_the_plain_one():
    """Activation checkpointing (each block recomputed in backward) and a sequence-parallel group of one
    (positions from the group, the loss its mean over real targets) give the plain forward's logits, loss
    (targets of -100 ignored) and gradients."""
    from zerotrain.comm import Comm
    from zerotrain.parallel.sequence import enable_sequence_parallel

    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    targets = torch.roll(idx, -1, dims=1)
    targets[0, :5] = -100
    plain = _tiny(dropout=0.0).train()
    want_logits, want_loss, want_grads = _loss_and_grads(plain, idx, targets)
    checkpointed = _tiny(dropout=0.0).train()
    checkpointed.activation_checkpointing = True
    sequence = _tiny(dropout=0.0).train()
    enable_sequence_parallel(sequence, Comm(None, 0, 1))
    for model in (checkpointed, sequence):
        logits, loss, grads = _loss_and_grads(model, idx, targets)
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_init_is_gpt2s_with_scaled_residual_projections():
    """N(0, 0.02) weights, the residual projections N(0, 0.02 / sqrt(2 * n_layer)), zero biases, unit norms."""
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, n_inner=256))  # enough values for a sample's moments
    resid = 0.02 / math.sqrt(2 * 2)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            mean, std = 0.0, resid
        elif p.dim() == 2:
            mean, std = 0.0, 0.02
        else:
            assert torch.equal(p, torch.ones_like(p) if name.endswith("ln_1.weight") or name.endswith("ln_2.weight")
                               or name.endswith("ln_f.weight") else torch.zeros_like(p)), name
            continue
        assert abs(p.mean().item() - mean) < 0.1 * std, name
        assert 0.9 * std < p.std().item() < 1.1 * std, name
