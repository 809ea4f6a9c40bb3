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
