"""zero.Init: each rank holds only its shard from construction on, values match a plain model,
initializers on a partitioned parameter touch the local shard only, and training is exact."""
from __future__ import annotations

import os

import torch

from distributed import run_distributed
from models_for_tests import OddMLP, assert_same_training, make_batches, reference_training, train_global_step


class ParentInitMLP(OddMLP):
    """Re-initializes its children's weights in its own __init__, after they are partitioned."""

    def __init__(self) -> None:
        super().__init__()
        torch.nn.init.normal_(self.fc1.weight, std=0.5)
        torch.nn.init.zeros_(self.fc2.bias)


class PaddedEmbedding(torch.nn.Module):
    """Initializes through indexing after its embedding is partitioned, as transformers' `_init_weights` does
    (`init.zeros_(module.weight[module.padding_idx])`). 7 x 6 = 42 elements, 21 per rank at world 2: row 3
    (elements 18-23) and column 0 straddle the two ranks' chunks; row 1 lies in rank 0's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(7, 6, padding_idx=3)
        with torch.no_grad():  # as transformers' initialize_weights
            early = self.embed.weight[1]  # a view taken before the redraw: scaling it later scales the new draw
            torch.nn.init.normal_(self.embed.weight, std=2.0)
            early.mul_(0.5)
            torch.nn.init.zeros_(self.embed.weight[3])
            self.embed.weight[:, 0].fill_(1.5)
            self.embed.weight[5] = torch.arange(6.0)


def padded_flat(tensor: torch.Tensor, world: int) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    return torch.cat([flat, flat.new_zeros(-(-flat.numel() // world) * world - flat.numel())])


def gather_all(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full values of every parameter, read through GatheredParameters (no write-back)."""
    import zerotrain

    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def is_released(param: torch.nn.Parameter) -> bool:
    """Partitioned and holding no full copy: the data is a one-element placeholder."""
    return not param._zero.gathered and param.data.untyped_storage().nbytes() <= param.element_size()


class WithIndex(torch.nn.Module):
    """A float weight and an integer parameter (frozen): Init(dtype=...) casts the first only."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(6))
        self.index = torch.nn.Parameter(torch.arange(6), requires_grad=False)


def construct_under_init() -> dict:
    import zerotrain

    torch.manual_seed(0)
    with zerotrain.zero.Init() as init:
        model = OddMLP()
    with zerotrain.zero.Init(enabled=False) as off:  # `with Init(...) as x` is the context itself, on or off
        pass
    entered = (type(init).__name__, type(off).__name__)
    with zerotrain.zero.Init(dtype=torch.bfloat16):
        mixed = WithIndex()
    with zerotrain.zero.GatheredParameters(list(mixed.parameters())):
        entered += (mixed.scale.dtype, mixed.index.dtype, mixed.index.detach().clone())
    after_init = {name: {"released": is_released(p), "shard": p._zero.shard.clone(), "shape": tuple(p.shape),
                         "ds_numel": p.ds_numel} for name, p in model.named_parameters()}
    gathered = gather_all(model)
    released_again = all(is_released(p) for p in model.parameters())
    torch.manual_seed(0)
    plain = {name: p.detach().clone() for name, p in OddMLP().named_parameters()}
    return {"after_init": after_init, "gathered": gathered, "released_again": released_again, "plain": plain,
            "entered": entered}


def test_init_holds_only_shards_and_gathers_the_plain_model():
    world = 4
    for rank, result in enumerate(run_distributed(construct_under_init, world)):
        for name, plain in result["plain"].items():
            info = result["after_init"][name]
            assert info["released"], f"rank {rank} {name}: no full copy right after construction"
            assert info["shape"] == tuple(plain.shape) and info["ds_numel"] == plain.numel()
            shard_numel = -(-plain.numel() // world)
            assert info["shard"].numel() == shard_numel, f"{name}: ceil({plain.numel()}/{world}) elements"
            # Same seed, same draws: the shard is this rank's chunk of the plain model's (padded) parameter.
            expected = padded_flat(plain, world)[rank * shard_numel:(rank + 1) * shard_numel]
            torch.testing.assert_close(info["shard"], expected, rtol=0, atol=0)
            torch.testing.assert_close(result["gathered"][name], plain, rtol=0, atol=0)
        assert result["released_again"], "GatheredParameters releases the full copies on exit"
        assert result["entered"][:4] == ("Init", "Init", torch.bfloat16, torch.int64)
        assert torch.equal(result["entered"][4], torch.arange(6))


def init_locally_then_gather() -> dict:
    import zerotrain

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    with zerotrain.zero.Init():
        model = OddMLP()
    before = gather_all(model)
    untouched = model.fc1.bias._zero.shard.clone()
    if rank == 0:
        torch.manual_seed(100)
        torch.nn.init.normal_(model.fc1.weight, std=5.0)
    if rank == 1:
        torch.nn.init.zeros_(model.fc2.weight)
    still_released = all(is_released(p) for p in model.parameters())
    shard_sizes = {name: p._zero.shard.numel() for name, p in model.named_parameters()}
    fc2_shard = model.fc2.weight._zero.shard.clone()
    bias_unchanged = torch.equal(model.fc1.bias._zero.shard, untouched)
    torch.manual_seed(1)
    with zerotrain.zero.Init():
        padded = PaddedEmbedding()
    try:
        padded.embed.weight[0].sum()  # reading a slice before an engine owns the parameter: refused
        read_error = None
    except RuntimeError as error:
        read_error = str(error)
    torch.manual_seed(1)
    return {"before": before, "after": gather_all(model), "still_released": still_released,
            "shard_sizes": shard_sizes, "fc2_shard": fc2_shard, "bias_unchanged": bias_unchanged,
            "indexed_init": gather_all(padded)["embed.weight"], "indexed_plain": PaddedEmbedding().embed.weight.detach(),
            "indexed_released": is_released(padded.embed.weight), "read_error": read_error}


def test_initializers_on_partitioned_parameters_change_only_the_local_shard():
    results = run_distributed(init_locally_then_gather, 2)
    assert results[0]["after"].keys() == results[1]["after"].keys()
    for name in results[0]["after"]:
        torch.testing.assert_close(results[0]["after"][name], results[1]["after"][name], rtol=0, atol=0)
    before, after = results[0]["before"], results[0]["after"]
    for result in results:
        assert result["still_released"], "an initializer on a released parameter never gathers it"
        assert result["shard_sizes"] == {"fc1.weight": 21, "fc1.bias": 4, "fc2.weight": 11, "fc2.bias": 2}
        assert result["bias_unchanged"]
    # fc1.weight (42 elements, 21 per rank): rank 0's normal_ redrew elements 0-20 only.
    old, new = before["fc1.weight"].reshape(-1), after["fc1.weight"].reshape(-1)
    assert torch.equal(new[21:], old[21:]), "rank 1's chunk is untouched"
    assert not torch.any(new[:21] == old[:21]), "rank 0's chunk is redrawn"
    assert new[:21].std() > 1.0, "drawn with std 5, not kept from the kaiming init"
    # fc2.weight (21 elements, 11 per rank, one padding element on rank 1): rank 1's zero_ hit 11-20 only.
    old, new = before["fc2.weight"].reshape(-1), after["fc2.weight"].reshape(-1)
    assert torch.equal(new[:11], old[:11]) and torch.all(old[11:] != 0) and torch.all(new[11:] == 0)
    assert torch.equal(results[1]["fc2_shard"], torch.zeros(11))
    for name in ("fc1.bias", "fc2.bias"):
        assert torch.equal(before[name], after[name]), f"{name}: not touched by anyone"
    # Indexed initializers on a partitioned parameter no engine owns (transformers' padding row): the plain values.
    for result in results:
        assert result["indexed_released"]
        plain = result["indexed_plain"]
        assert torch.all(plain[3, 1:] == 0) and torch.all(plain[:5, 0] == 1.5) and torch.equal(plain[5], torch.arange(6.0))
        assert plain[6, 1:].abs().sum() > 1, "the rows not indexed keep their normal_ draw"
        torch.testing.assert_close(result["indexed_init"], plain, rtol=0, atol=0)
        assert result["read_error"] and "GatheredParameters" in result["read_error"], result["read_error"]


def train_from_init(steps: int, tmp: str) -> dict:
    """Built under zero.Init: plain, with offload_param cpu and nvme, and saved halfway then resumed into a
    model built under zero.Init and one built plainly (other initial weights: the load replaces them)."""
    import zerotrain

    world = int(os.environ["WORLD_SIZE"])
    batches, half = make_batches(steps, 2 * world), steps // 2
    nvme = {"device": "nvme", "nvme_path": os.path.join(tmp, "nvme"), "buffer_count": 2, "buffer_size": 64,
            "max_in_cpu": 20}

    def build(seed: int, under_init: bool = True, **zero):
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
                  "steps_per_print": 0}
        torch.manual_seed(seed)
        with zerotrain.zero.Init(enabled=under_init, config=config if zero else None):
            model = ParentInitMLP()
        if zero.get("offload_param", {}).get("device") == "nvme":  # Init wrote each shard as it partitioned
            parts = [param._zero for param in model.parameters()]
            stores = {id(part.store): part.store for part in parts}
            store = parts[0].store
            results["host after zero.Init (nvme)"] = {
                "stores": len(stores), "kind": store.kind, "in memory": [p.names[0] for p in parts if p._shard is not None],
                "cached": store.cached_numel, "shards": sum(p.shard_numel for p in parts),
                "on disk": store.memory_split()["nvme"], "pool": store.pool.total_bytes()}
        initial = gather_all(model) if under_init else None
        return initial, zerotrain.initialize(model=model, config=config)[0]

    def train(engine, part) -> list[float]:
        return [train_global_step(engine, batch, 2) for batch in part]

    results = {}
    initial, engine = build(0)
    losses = train(engine, batches[:half])
    engine.save_checkpoint(os.path.join(tmp, "ckpt"), tag="half")
    results.update({"initial": initial, "zero.Init": (losses + train(engine, batches[half:]), engine.full_state_dict())})
    engine.close()
    for what, zero in (("zero.Init + offload_param cpu", {"offload_param": {"device": "cpu"}}),
                       ("zero.Init + offload_param nvme", {"offload_param": nvme})):
        _, engine = build(0, **zero)
        results[what] = (train(engine, batches), engine.full_state_dict())
        engine.close()
    for what, under_init in (("resumed under zero.Init", True), ("resumed, built without zero.Init", False)):
        _, engine = build(123, under_init)
        engine.load_checkpoint(os.path.join(tmp, "ckpt"))
        results[what] = (train(engine, batches[half:]), engine.full_state_dict())
        engine.close()
    results["param store lifecycle"] = init_store_lifecycle(os.path.join(tmp, "lifecycle"), batches)
    return results


class FailsInInit(torch.nn.Module):
    """A model whose construction fails after its first layer was partitioned (and written to NVMe)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 7)
        raise RuntimeError("model construction failed")


def init_store_lifecycle(tmp: str, batches: list) -> dict:
    """zero.Init's NVMe parameter store under a bf16 config: Init given no dtype (kept in a variable) or bf16;
    a model whose construction raises inside Init; an initialize that fails after the parameter store is built.
    What each leaves open under nvme_path (swap directories, open files) and which I/O threads still run.
    The garbage collector is off, so what is left is what the code closed, not what a collection freed."""
    import gc
    import sys
    import threading
    import zerotrain

    nvme = os.path.join(tmp, f"nvme-{os.environ['RANK']}")  # this rank's directories only

    def left() -> dict:
        fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}")]
        return {"dirs": sorted(os.listdir(nvme)) if os.path.isdir(nvme) else [],
                "files": [path for path in fds if path.startswith(nvme)],
                "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("zerotrain-aio"))}

    def config(threshold: int = 0, **zero) -> dict:
        return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "bf16": {"enabled": True}, "steps_per_print": 0,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold,
                                      "offload_param": {"device": "nvme", "nvme_path": nvme}, **zero}}

    results = {"before": left()}
    gc.disable()
    try:
        # threshold 100: every parameter persistent, so Init's store keeps no shard and the engine builds its own
        for dtype, threshold in ((None, 0), (torch.bfloat16, 0), (None, 100)):
            torch.manual_seed(0)
            with zerotrain.zero.Init(config=config(threshold), dtype=dtype) as init:  # `init` lives on, as a user's
                model = OddMLP()
            after_init = left()["dirs"]
            engine = zerotrain.initialize(model=model, config=config(threshold))[0]
            after_initialize = left()["dirs"]
            losses = [train_global_step(engine, batch, 2) for batch in batches[:2]]
            engine.close()
            results[f"Init dtype {dtype}, threshold {threshold}"] = {
                "after Init": after_init, "after initialize": after_initialize, "losses": losses,
                "after close": left(), "init": type(init).__name__}
            del engine, model
        try:
            with zerotrain.zero.Init(config=config()):
                FailsInInit()
        except RuntimeError as error:
            results["construction raised"] = (str(error), left())
        import zerotrain.offload.nvme_records as nvme_records

        real_open = nvme_records.open_swap_directory

        def refuse(*args, **kwargs):  # an nvme_path that is a file is now refused with the config, before any part
            raise FileExistsError("the optimizer's swap directory cannot be made")

        nvme_records.open_swap_directory = refuse
        try:  # the optimizer's swap directory cannot be made: after the parameter store was built
            zerotrain.initialize(model=OddMLP(), config=config(offload_optimizer={"device": "nvme",
                                                                                  "nvme_path": os.path.join(tmp, "o")}))
        except OSError as error:
            results["initialize raised"] = (type(error).__name__, left())
        finally:
            nvme_records.open_swap_directory = real_open
        from zerotrain.config import ConfigError

        saved = sys.modules.get("wandb")
        sys.modules["wandb"] = None  # `import wandb` raises ImportError, as when it is not installed
        try:
            zerotrain.initialize(model=OddMLP(), config=dict(config(), wandb={"enabled": True}))
        except ConfigError as error:
            results["monitor refused"] = (error.key, left())
        finally:
            sys.modules.pop("wandb")
            if saved is not None:
                sys.modules["wandb"] = saved
    finally:
        gc.enable()
    return results


def test_training_from_init_matches_single_process_from_the_gathered_weights(tmp_path):
    """zero.Init alone, with offload_param (cpu, nvme) and with a checkpoint saved at stage 3 and resumed
    (into zero.Init or a plainly built model) all train as one process does from the gathered weights."""
    steps = 4
    results = run_distributed(train_from_init, 2, steps, str(tmp_path), timeout=150)[0]
    initial = results.pop("initial")
    check_param_store_lifecycle(results.pop("param store lifecycle"))
    # Accounting: under an offload_param nvme config zero.Init hands every shard to the NVMe store as it
    # partitions: none stays in host memory but the bounded cache (max_in_cpu 20 elements) and the buffer pool.
    host = results.pop("host after zero.Init (nvme)")
    assert host["stores"] == 1 and host["kind"] == "nvme" and host["in memory"] == [], host
    assert host["on disk"] == host["shards"] * 4 and host["shards"] > 20 >= host["cached"], host
    assert host["pool"] <= 2 * 4096, host  # buffer_count 2 × the largest shard (one aligned block)
    torch.manual_seed(0)
    plain = ParentInitMLP()
    # A parent's random initializer on an already partitioned child parameter draws the whole
    # tensor and keeps the local chunk (partition.py), so every weight equals the plain model's.
    assert torch.equal(initial["fc1.weight"], plain.fc1.weight.detach())
    assert torch.equal(initial["fc2.weight"], plain.fc2.weight.detach())
    assert torch.equal(initial["fc2.bias"], torch.zeros(3))

    def from_gathered() -> torch.nn.Module:
        model = ParentInitMLP()
        model.load_state_dict(initial)
        return model

    ref_losses, ref_weights = reference_training(from_gathered, make_batches(steps, 4), lr=1e-2, weight_decay=0.0)
    whole_losses, whole_weights = results["zero.Init"]
    for what, (losses, weights) in results.items():
        resumed = what.startswith("resumed")
        try:
            assert_same_training(losses, weights, ref_losses[steps // 2:] if resumed else ref_losses, ref_weights)
        except AssertionError as error:
            raise AssertionError(f"{what}: {error}") from None
        if resumed:  # exact resume: the uninterrupted run's second half, bit for bit
            assert losses == whole_losses[steps // 2:], (what, losses, whole_losses)
            for name, value in whole_weights.items():
                assert torch.equal(weights[name], value), (what, name)


def check_param_store_lifecycle(result: dict) -> None:
    """What `init_store_lifecycle` left: nothing open after engine.close() or a failed build, under a bf16
    config whether or not zero.Init was given the dtype; the store Init wrote is the one the engine uses."""
    nothing = {"dirs": [], "files": [], "threads": []}
    assert result["before"] == nothing, result["before"]
    for what in ("Init dtype None, threshold 0", "Init dtype torch.bfloat16, threshold 0",
                 "Init dtype None, threshold 100"):
        run = result[what]
        assert len(run["after Init"]) == 1 and run["after Init"][0].startswith("zerotrain-param-r"), run
        if what.endswith("threshold 0"):
            # initialize casts the shards Init wrote (fp32 when Init had no dtype) in their store: no second file
            assert run["after initialize"] == run["after Init"], (what, run)
        assert run["after close"] == nothing, (what, run["after close"])
        assert run["init"] == "Init"
    # The cast in the store is the cast Init(dtype=bf16) makes: the same run, bit for bit.
    losses = [result[what]["losses"] for what in result if what.startswith("Init dtype")]
    assert losses[0] == losses[1] == losses[2], losses
    message, after = result["construction raised"]
    assert message == "model construction failed" and after == nothing, (message, after)
    error, after = result["initialize raised"]
    assert error == "FileExistsError" and after == nothing, after
    key, after = result["monitor refused"]
    assert key == "wandb.enabled" and after == nothing, after


def reinit_after_initialize(steps: int) -> tuple:
    """Re-initialize released parameters of a running engine with torch.nn.init, then train."""
    import zerotrain

    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 0}
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=config)
    torch.nn.init.constant_(engine.module.fc2.bias, 0.5)  # passes the tensor by keyword
    torch.nn.init.zeros_(engine.module.fc1.weight)
    released = all(is_released(p) for p in engine.module.parameters())
    initial = engine.full_state_dict()
    losses = [train_global_step(engine, batch, 2) for batch in make_batches(steps, 2 * world)]
    return released, initial, losses, engine.full_state_dict()


def test_nn_init_on_a_running_engine_changes_shards_and_masters():
    steps = 2
    released, initial, losses, weights = run_distributed(reinit_after_initialize, 2, steps)[0]
    assert released, "the initializers ran on the shards, without gathering"
    assert torch.equal(initial["fc2.bias"], torch.full((3,), 0.5))
    assert torch.equal(initial["fc1.weight"], torch.zeros(7, 6))

    def reinitialized() -> torch.nn.Module:
        model = OddMLP()
        with torch.no_grad():
            model.fc2.bias.fill_(0.5)
            model.fc1.weight.zero_()
        return model

    ref_losses, ref_weights = reference_training(reinitialized, make_batches(steps, 4), lr=1e-2, weight_decay=0.0)
    assert_same_training(losses, weights, ref_losses, ref_weights)
