"""A forward-only engine (ZeRO-Inference, `zero.forward_only`) in the pytest process, at a world of one: each forward
of the root module, however nested, is one micro-step of the stage-3 fetcher and one "forward" phase; the model's
values are the plain model's; offloaded parameters are read ahead across forwards; a training engine's generate and
`synced_generate` pass transformers' `synced_gpus` as documented. Seconds, so `forward_only.py` can be put under
mutation (`tools/mutate.py`'s `COVERING`); the multi-rank case is tests/test_inference.py's launch."""
from __future__ import annotations

import json

import pytest
import torch

from models_for_tests import OddMLP

import zerotrain
from zerotrain.zero.forward_only import NoOptimizerError, generate_between_steps, synced_generate


class CallsItself(OddMLP):
    """A root module whose forward calls the root module again (nested forward): one forward for the engine."""

    def forward(self, x: torch.Tensor, inner: bool = False):
        if inner:
            return super().forward(x)
        return self(x, inner=True) * 2


def _phases(path) -> list[tuple[str, str]]:
    with open(path) as handle:
        records = [json.loads(line) for line in handle][1:]
    return [(r["event"], r["boundary"]) for r in records if r.get("boundary") == "forward"]


@pytest.mark.parametrize("stage", [1, 3])
def test_each_root_forward_counts_once_is_one_phase_and_releases_its_gathers(stage, tmp_path, world_of_one):
    """Three forwards of a model that calls itself: the plain model's values, the count 3 (the nested call is part
    of its forward), one "forward" begin/end pair each on the memory timeline, and at stage 3 nothing gathered
    after each forward, the second and third following the first's record (prefetch hits, no mismatch)."""
    from zerotrain.monitor import MemoryTimeline

    torch.manual_seed(0)
    model, reference = CallsItself(), CallsItself()
    reference.load_state_dict(model.state_dict())
    engine = zerotrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})[0]
    assert engine.forward_passes.count == 0
    timeline = MemoryTimeline(tmp_path / "timeline", rank=0)
    engine.watch_memory(timeline)
    hits = []
    for seed in range(3):
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(engine(x), reference(x).detach(), rtol=0, atol=0)
        assert engine.forward_passes.count == seed + 1
        gather = engine.work_stats()["gather"]
        if stage == 3:
            assert gather["live_bytes"] == 0 and gather["inflight_bytes"] == 0, gather
            assert gather["order_mismatches"] == 0, gather
            hits.append(gather["prefetch_hits"])
    engine.watch_memory(None)
    timeline.close()
    assert _phases(timeline.path) == [("begin", "forward"), ("end", "forward")] * 3
    if stage == 3:
        assert hits[0] < hits[1] < hits[2], hits
    with pytest.raises(NoOptimizerError, match="engine.step\\(\\)"):
        engine.step()
    engine.close()


def test_offloaded_parameters_are_read_ahead_across_forwards(tmp_path, world_of_one):
    """Parameters on NVMe (stage 3): from the third forward on, each parameter's read is one read ahead, the
    forward's first included (the reads ahead wrap from the end of one forward to the start of the next)."""
    from zerotrain.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    count = len(list(model.parameters()))
    engine = zerotrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4,
                                                "buffer_size": 100_000, "max_in_cpu": 1000}}})[0]
    idx = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    hits = []
    for _ in range(3):
        engine(idx)
        hits.append(engine.work_stats()["param_store"]["read_ahead_hits"])
    engine.close()
    assert hits[2] - hits[1] == count, hits


class Generating(torch.nn.Module):
    """A model whose generate records its arguments, the grad mode and its training flag."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.seen: list = []

    def generate(self, *args, **kwargs):
        self.seen.append((args, kwargs, torch.is_grad_enabled(), self.training))
        return "generated"


def test_generate_between_steps_and_synced_generate_pass_synced_gpus_as_documented():
    """A training engine's generate: synced, `synced_gpus=True` even over the caller's False; unsynced, the
    caller's arguments as they are; both under no_grad in eval mode, the module training after, `before_use`
    called once a call. `synced_generate`: True where the caller gave none, the caller's explicit value kept."""
    model, used = Generating(), []
    synced = generate_between_steps(model.generate, model, before_use=lambda: used.append(1), synced=True)
    plain = generate_between_steps(model.generate, model, synced=False)
    assert synced(3, synced_gpus=False) == "generated" and plain(4, top_k=1) == "generated"
    assert model.seen == [((3,), {"synced_gpus": True}, False, False), ((4,), {"top_k": 1}, False, False)]
    assert model.training and used == [1]
    model.seen.clear()
    wrapped = synced_generate(model.generate)
    wrapped(1)
    wrapped(2, synced_gpus=False)
    assert [seen[1] for seen in model.seen] == [{"synced_gpus": True}, {"synced_gpus": False}]


def test_generate_between_training_steps_leaves_the_training_and_its_reads_as_without(tmp_path, world_of_one):
    """A stage-3 training engine with parameters on NVMe, three steps, its model's generate called before the
    second: every step's loss is the run's without the generate, and the third step reads the parameter file as
    that run does (the generate's forwards change no read ahead of the training's record: none wraps into a next
    forward, none wasted)."""
    from zerotrain.models import GPT, GPTConfig

    class Generating(GPT):
        def generate(self, idx: torch.Tensor, new: int) -> torch.Tensor:
            for _ in range(new):
                logits, _ = self(idx)
                idx = torch.cat([idx, logits[:, -1:].argmax(-1)], 1)
            return idx

    def run(path: str, generate: bool) -> tuple[list[float], dict]:
        torch.manual_seed(0)
        engine = zerotrain.initialize(model=Generating(GPTConfig.preset("tiny")), config={
            "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_param": {"device": "nvme", "nvme_path": path, "buffer_count": 4,
                                                    "buffer_size": 100_000, "max_in_cpu": 1000}}})[0]
        losses, reads = [], {}
        for step in range(3):
            idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
            if step == 1 and generate:
                assert engine.module.generate(idx[:1, :4], 2).shape == (1, 6)
            before = dict(engine.work_stats()["param_store"])
            _, loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            reads = {key: value - before[key] for key, value in engine.work_stats()["param_store"].items()}
        engine.close()
        return losses, reads

    plain = run(str(tmp_path / "plain"), False)
    assert plain[1]["read_ahead"] > 0, plain
    assert run(str(tmp_path / "generated"), True) == plain
