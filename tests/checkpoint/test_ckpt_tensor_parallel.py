"""Tensor-parallel engines save whole tensors in the unified format and load at any tensor-parallel degree.

A TP=2 checkpoint holds the same whole tensors (model, optimizer states) as `full_state_dict`
and as a TP=1 run at the same step; loaded into TP=1 (and a TP=1 checkpoint into TP=2) and
saved again it gives back exactly the same files, and training continues with the losses of
the uninterrupted run. Tiny GPT: the fused q/k/v projection (several pieces per rank), row
splits (strided in the whole tensor), the tied vocab-split embedding.
"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_distributed

SEQ, VOCAB, GLOBAL_BATCH, LR, STEPS = 8, 64, 4, 1e-3, 4


def gpt(seed: int = 0, n_inner: int = 32):
    from zerotrain.models import GPT, GPTConfig
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=1, n_head=4, n_embd=16, block_size=SEQ, n_inner=n_inner))


def make_engine(tp: int, stage: int, seed: int = 0, n_inner: int = 32, frozen: str = ""):
    import zerotrain
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = gpt(seed, n_inner)
    if frozen:
        model.get_parameter(frozen).requires_grad_(False)
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (world // tp),
              "gradient_clipping": 1.0,
              # eps=1e-6: see EPS in tests/parallel/test_tensor_parallel_engine.py (every tensor compared)
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "eps": 1e-6}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,  # parameters span shard boundaries
                                    "stage3_param_persistence_threshold": 0},
              "tensor_parallel": {"autotp_size": tp}, "steps_per_print": 0, "comm_timeout_seconds": 60}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    return engine


def train(engine, first: int, count: int) -> list[float]:
    """Global steps [first, first+count) of a fixed token sequence; the global mean loss of each."""
    import torch.distributed as dist
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]
    dp, dp_rank = engine.topology.dp_size, engine.topology.dp_rank
    micro = GLOBAL_BATCH // dp
    losses = []
    for tokens in batches[first:first + count]:
        mine = tokens[dp_rank * micro:(dp_rank + 1) * micro]
        _, loss = engine(mine[:, :-1], mine[:, 1:])
        engine.backward(loss)
        engine.step()
        total = loss.detach().reshape(1).clone()
        if dist.is_initialized():
            dist.all_reduce(total)  # every tensor-parallel rank holds its data-parallel rank's loss
            total /= dist.get_world_size()
        losses.append(total.item())
    return losses


def save_and_continue(tp: int, stage: int, save_dir: str, before: int, async_save: bool = False) -> tuple:
    """Train `before` steps, save, then train to STEPS: (full weights at the save, losses after it, final weights)."""
    engine = make_engine(tp, stage)
    train(engine, 0, before)
    saved = engine.full_state_dict()
    engine.save_checkpoint(save_dir, tag="ckpt", async_save=async_save)  # async: written while training goes on
    losses = train(engine, before, STEPS - before)
    engine.wait_checkpoint()
    return saved, losses, engine.full_state_dict()


def load_resave_continue(tp: int, stage: int, load_dir: str, resave_dir: str, before: int) -> tuple:
    """Load into a fresh engine (other initial weights), save again at once, train to STEPS."""
    engine = make_engine(tp, stage, seed=7)
    engine.load_checkpoint(load_dir, tag="ckpt")
    engine.save_checkpoint(resave_dir, tag="ckpt")
    losses = train(engine, before, STEPS - before)
    return losses, engine.full_state_dict()


def run(fn, world: int, *args):
    # World 1 too in its own process: a process group started in pytest's process would outlive the test.
    return run_distributed(fn, world, *args, timeout=120)


def read_kind(directory: str, kind: str) -> dict[str, torch.Tensor]:
    """Every tensor of one kind (model, optimizer) of a checkpoint, read by safetensors itself."""
    with open(os.path.join(directory, f"{kind}.safetensors.index.json")) as handle:
        files = set(json.load(handle)["weight_map"].values())
    tensors = {}
    for name in sorted(files):
        tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def assert_files_equal(got_dir: str, want_dir: str) -> None:
    for kind in ("model", "optimizer"):
        got, want = read_kind(got_dir, kind), read_kind(want_dir, kind)
        assert set(got) == set(want), f"{kind}: {sorted(set(got) ^ set(want))}"
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"{kind} {name} differs after load and re-save"


def assert_close(got: dict, want: dict, what: str) -> None:
    """Every tensor (weights and optimizer states) at the project's exact tolerance: rtol 1e-5, atol 1e-6."""
    assert set(got) >= set(want), f"{what}: missing {sorted(set(want) - set(got))}"
    for name, expected in want.items():
        torch.testing.assert_close(got[name].float(), expected.float(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


def assert_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5, (got, want)


def check_saved_whole(directory: str, full: dict) -> None:
    """The model files hold exactly `full_state_dict()`'s whole tensors (tied ones once)."""
    model = read_kind(directory, "model")
    assert set(model) <= set(full) and set(full) - set(model) == {"lm_head.weight"}  # tied to wte: saved once
    for name, tensor in model.items():
        assert tensor.shape == full[name].shape, name
        assert torch.equal(tensor, full[name]), f"saved {name} differs from full_state_dict"


@pytest.mark.parametrize("world, stage", [(2, 1), (4, 2)])
def test_tp2_checkpoint_holds_whole_tensors_and_resumes_at_tp1(tmp_path, world, stage):
    """TP=2 (x DP=2 at world 4, saving asynchronously) saves whole tensors; TP=1 loads them and continues
    like the TP=2 run."""
    before = 2
    tp_dir, resave_dir, ref_dir = str(tmp_path / "tp2"), str(tmp_path / "tp1"), str(tmp_path / "ref")
    saved, losses, final = run(save_and_continue, world, 2, stage, tp_dir, before, world == 4)[0]
    check_saved_whole(os.path.join(tp_dir, "ckpt"), saved)
    # the same steps at TP=1 in one process: the TP=2 files hold the same model and optimizer states
    ref_saved, ref_losses, _ = run(save_and_continue, 1, 1, 0, ref_dir, before)[0]
    for kind in ("model", "optimizer"):
        assert_close(read_kind(os.path.join(tp_dir, "ckpt"), kind), read_kind(os.path.join(ref_dir, "ckpt"), kind),
                     f"TP=2 vs TP=1 {kind}")
    assert_losses(losses, ref_losses)

    resumed_losses, resumed_final = run(load_resave_continue, 2 if world == 4 else 1, 1, stage, tp_dir,
                                        resave_dir, before)[0]
    assert_files_equal(os.path.join(resave_dir, "ckpt"), os.path.join(tp_dir, "ckpt"))
    assert_losses(resumed_losses, losses)
    assert_close(resumed_final, final, "resumed at TP=1 vs uninterrupted TP=2")


def tp1_into_tp2_worker(load_dir: str, resave_dir: str, bad_dir: str, before: int) -> tuple:
    """A model of the wrong shape is refused; the right one loads, re-saves and continues."""
    from zerotrain.checkpoint import CheckpointError
    wrong = make_engine(2, 3, n_inner=64)
    try:
        wrong.load_checkpoint(load_dir, tag="ckpt")
        message = "no error"
    except CheckpointError as error:
        message = str(error)
    return (message,) + load_resave_continue(2, 3, load_dir, resave_dir, before)


def test_tp1_checkpoint_loads_into_tp2_with_zero3_and_a_wrong_shape_is_refused(tmp_path):
    before = 2
    tp1_dir, resave_dir = str(tmp_path / "tp1"), str(tmp_path / "tp2")
    _, losses, final = run(save_and_continue, 1, 1, 0, tp1_dir, before)[0]
    results = run_distributed(tp1_into_tp2_worker, 4, tp1_dir, resave_dir, str(tmp_path / "bad"), before,
                              timeout=120)
    for message, *_ in results:  # the whole shape the TP=2 model expects, not its local slice's
        assert re.search(r"tensor 'transformer\.h\.0\.mlp\.c_\w+\.\w+[^']*' in \S+ has shape \[[\d, ]+\], "
                         r"the model expects \[[\d, ]*64[\d, ]*\]", message), message
    resumed_losses, resumed_final = results[0][1:]
    assert_files_equal(os.path.join(resave_dir, "ckpt"), os.path.join(tp1_dir, "ckpt"))
    assert_losses(resumed_losses, losses)
    assert_close(resumed_final, final, "resumed at TP=2 x DP=2 (stage 3) vs uninterrupted TP=1")


def frozen_split_worker(save_dir: str) -> tuple:
    """A frozen split parameter: saved whole at stage 3 (a frozen slot), loaded at stage 1 (a frozen slot of
    this rank's slice, whole on each data-parallel rank), saved whole again at stage 1 (every tensor-parallel
    rank's slice joined, as LoRA's frozen base under tensor parallelism needs)."""
    frozen = "transformer.h.0.mlp.c_fc.weight"
    engine = make_engine(2, 3, frozen=frozen)
    train(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="ckpt")
    saved = engine.full_state_dict()
    other = make_engine(2, 1, seed=7, frozen=frozen)
    other.load_checkpoint(save_dir, tag="ckpt")
    other.save_checkpoint(save_dir, tag="stage1")
    return saved, other.full_state_dict()


def test_frozen_split_parameter_saves_at_stage3_loads_and_saves_at_stage1(tmp_path):
    saved, loaded = run_distributed(frozen_split_worker, 2, str(tmp_path), timeout=120)[0]
    check_saved_whole(str(tmp_path / "ckpt"), saved)
    assert set(loaded) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), f"{name} differs after loading into stage 1"
    check_saved_whole(str(tmp_path / "stage1"), saved)


@pytest.mark.parametrize("window", [1, 7, 64, 1 << 20])
def test_a_local_range_of_a_split_tensor_reads_from_the_whole_tensor(tmp_path, monkeypatch, window):
    """Every local range of every slice (fused parts, strided dims) reads what `TensorSlice.take` gives,
    whatever the read window (one run, several runs per window, runs longer than the window)."""
    from safetensors.torch import save_file

    from zerotrain.checkpoint import split
    from zerotrain.checkpoint.reader import TensorReader
    from zerotrain.parallel.slices import split_slice

    monkeypatch.setattr(split, "WINDOW_ELEMENTS", window)
    whole = torch.arange(4 * 6 * 12, dtype=torch.float32).reshape(4, 6, 12)
    save_file({"w": whole}, str(tmp_path / "w.safetensors"))
    with TensorReader(str(tmp_path), {"w": "w.safetensors"}, "model weights") as reader:
        for dim, parts, size in [(0, 1, 2), (1, 3, 2), (2, 1, 4), (2, 3, 2)]:
            for rank in range(size):
                tensor_slice = split_slice(tuple(whole.shape), dim, rank, size, parts)
                local = tensor_slice.take(whole).reshape(-1)
                for start, count in [(0, local.numel()), (5, 17), (local.numel() - 3, 3), (11, 0)]:
                    target = torch.full((count + 2,), -1.0)
                    split.RunsRead(reader, "w", tensor_slice, start, count, 1).into(target)
                    assert torch.equal(target[1:1 + count], local[start:start + count]), (dim, parts, rank, start)
                    assert target[0] == -1 and target[-1] == -1
