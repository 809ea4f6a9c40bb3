"""The engine `zerotrain.initialize` returns has every member of `zerotrain.training_engine.TrainingEngine`, its own
(not forwarded to the model by `__getattr__`), so a trainer typed with the Protocol runs on it."""
from __future__ import annotations

import inspect

import torch

import zerotrain
from zerotrain.models import GPT, GPTConfig
from zerotrain.training_engine import TrainingEngine


def protocol_members() -> set[str]:
    """Every member the Protocol declares: its methods, properties and annotated attributes."""
    names = {name for name in vars(TrainingEngine) if not name.startswith("_")} | set(TrainingEngine.__annotations__)
    return names | {"__call__"}


def test_the_engine_has_every_member_of_the_protocol():
    torch.manual_seed(0)
    started = torch.distributed.is_initialized()
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zerotrain.initialize(model=GPT(GPTConfig.preset("tiny")), config=config)
    try:
        members = protocol_members()
        assert {"backward", "step", "config", "counters", "last_save", "sequence_parallel"} <= members
        own = set(dir(type(engine))) | set(vars(engine))
        assert sorted(members - own) == [], "TrainingEngine members the engine lacks (or only forwards to its model)"
        for name in members:
            declared = inspect.getattr_static(TrainingEngine, name, None)
            if inspect.isfunction(declared):  # a method in the Protocol is a method of the engine
                assert callable(getattr(engine, name)), name
        assert engine.counters is not None and engine.last_save() == (False, None)
    finally:
        engine.close()
        if not started and torch.distributed.is_initialized():  # a world of one, this test's own
            torch.distributed.destroy_process_group()


def _required(name: str) -> bool:
    """Whether the Protocol's member `name` is a method without a neutral default (its body ends in `...`; a
    neutral default returns a value or does nothing, its body a docstring): an engine must define it."""
    import ast
    import textwrap

    declared = inspect.getattr_static(TrainingEngine, name, None)
    if not inspect.isfunction(declared):
        return False
    body = ast.parse(textwrap.dedent(inspect.getsource(declared))).body[0].body
    return isinstance(body[-1], ast.Expr) and body[-1].value.__class__ is ast.Constant and \
        body[-1].value.value is Ellipsis


def test_one_engine_protocol_and_the_pipeline_engine_defines_every_required_member():
    """Issue 42: one `TrainingEngine` (hf/trainer.py and pipe/engine.py declared their own); the pipeline engine,
    which subclasses it, defines every member that has no neutral default (none falls back to the stub, which
    would return None), and the stage engine's interface extends it."""
    import ast
    from pathlib import Path

    from zerotrain.pipe import PipelineEngine
    from zerotrain.pipe.engine import StageEngine

    required = sorted(name for name in protocol_members() if _required(name))
    assert {"zero_optimization_stage", "full_state_dict", "load_checkpoint", "backward", "step"} <= set(required)
    missing = [name for name in required
               if inspect.getattr_static(PipelineEngine, name) is inspect.getattr_static(TrainingEngine, name)]
    assert missing == [], "TrainingEngine members PipelineEngine leaves to the Protocol's stub"
    assert TrainingEngine in StageEngine.__mro__
    root = Path(zerotrain.__file__).parent
    engines = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Engine") and any(
                    isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases):
                engines.append(f"{path.relative_to(root)}:{node.name}:{[ast.unparse(b) for b in node.bases]}")
    assert engines == ["pipe/engine.py:StageEngine:['TrainingEngine', 'Protocol']",
                       "training_engine.py:TrainingEngine:['Protocol']"], engines


def test_external_backward_counts_the_micro_batches_it_stands_for():
    """`external_backward(micro_steps=N)` (a pipeline schedule's N micro-batches in one block) advances the
    micro-step count by N - 1, the boundary `step()` by the last: a whole accumulation cycle, as N backward()s
    would (the pipeline engine wrote `engine.micro_steps` from outside)."""
    torch.manual_seed(0)
    started = torch.distributed.is_initialized()
    config = {"train_batch_size": 3, "gradient_accumulation_steps": 3, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zerotrain.initialize(model=GPT(GPTConfig.preset("tiny")), config=config)
    try:
        x = torch.randint(0, 64, (1, 8))
        for cycle in (1, 2):
            with engine.external_backward(micro_steps=3):
                for _ in range(3):
                    engine.module(x, x)[1].div(3).backward()
            engine.set_gradient_accumulation_boundary(True)
            engine.step()
            assert (engine.micro_steps, engine.global_steps) == (3 * cycle, cycle)
    finally:
        engine.close()
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_an_engine_of_the_required_members_gets_the_protocols_neutral_defaults():
    """An engine that defines only what the Protocol requires (a trainer's own engine) reports nothing it does not
    have: no counters, no sequence parallelism, loss scale 1, no save pending, training mode, train()/eval() itself,
    no gradient norm, no timers, no offload counters, a progress switch that does nothing; its device is its
    topology's."""
    from types import SimpleNamespace

    minimal = type("Minimal", (TrainingEngine,), {name: (lambda self, *a, **k: None) for name in protocol_members()
                                                   if _required(name) and name != "__call__"})()
    minimal.topology = SimpleNamespace(device=torch.device("cpu"))
    assert (minimal.counters, minimal.sequence_parallel, minimal.loss_scale) == (None, None, 1.0)
    assert minimal.last_save() == (False, None) and minimal.training is True
    assert minimal.train() is minimal and minimal.eval() is minimal and minimal.device == torch.device("cpu")
    assert (minimal.get_global_grad_norm(), minimal.get_wall_clock_timers(), minimal.offload_stats()) == (None, {}, {})
    with minimal.progress_printing(False) as inside:
        assert inside is None
    assert minimal.wait_checkpoint() is None and minimal.claim_save_dir("x") is None and minimal.close() is None
