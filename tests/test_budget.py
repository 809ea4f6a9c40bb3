"""The memory budget (zerotrain.budget, issue #27): the size keys a config leaves unset follow the budget, a key
the config sets wins, a run that cannot fit is refused with the numbers, and the host memory is read from the
cgroup as well as /proc/meminfo. In-process, on the pure functions; the world-2 agreement and the refusal by
`initialize` before any step are checked in tests/offload/test_offload_param.py (one launch with its training)."""
from __future__ import annotations

import os

import pytest
import torch

from zerotrain.budget import (DEEPSPEED, MIN_BUCKET, SHARES, check_fits, default_budget, host_memory_available,
                              plan_sizes)
from zerotrain.config import ConfigError, load_config
from zerotrain.estimate import (config_option, estimate_option, format_bytes, load_meta_model, model_shape,
                                probe_optimizer)

GiB = 2**30


def nvme_config(**zero) -> object:
    block = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/unused"},
             "offload_optimizer": {"device": "nvme", "nvme_path": "/unused"}}
    for key, value in zero.items():
        if isinstance(value, dict):
            block[key] = {**block[key], **value}
        else:
            block[key] = value
    return load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": block})


@pytest.fixture(scope="module")
def shape():
    model, _ = load_meta_model("70m", torch.bfloat16, layers=4, width=2112)  # 4 x 2112: MLP weights 8.9M elements
    return model_shape(model)


def largest_shard(shape) -> int:
    return -(-max(p.numel for p in shape.params) // 2)  # world 2


def test_sizes_follow_the_budget(shape):
    """A small and a large budget give different sizes: each unset key takes its documented share of the
    headroom (budget - model states), between its smallest useful value and DeepSpeed's default."""
    config = nvme_config()
    small, large = plan_sizes(2 * GiB, shape, 2, config), plan_sizes(64 * GiB, shape, 2, config)
    headroom = small.budget - small.states
    assert 0 < headroom < small.budget
    # stage 3: the reduce bucket at most the largest parameter (its share of 2 GiB would be 44M elements: a bucket
    # that large held 2.5x the largest parameter's whole gradients at once, above FSDP2's one block)
    assert SHARES["reduce_bucket_size"] * headroom / (2 * 2) > 2 * largest_shard(shape)  # bf16
    assert small.value("reduce_bucket_size") == 2 * largest_shard(shape)  # the largest parameter, padded
    half = plan_sizes(small.states + int(2 * 2 * 2 * largest_shard(shape) / SHARES["reduce_bucket_size"]) // 2, shape,
                      2, config)  # a headroom whose share is half the cap: the share
    assert MIN_BUCKET < half.value("reduce_bucket_size") < 2 * largest_shard(shape)
    assert "the largest parameter (the headroom allows more)" in "\n".join(small.lines())
    # stages 1-2 keep DeepSpeed's default as the cap (their flat buckets hold a shard of every gradient anyway)
    stage2 = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {}},
                          "zero_optimization": {"stage": 2}})
    assert plan_sizes(64 * GiB, shape, 2, stage2).value("reduce_bucket_size") == DEEPSPEED["reduce_bucket_size"]
    assert small.value("stage3_max_live_parameters") == int(SHARES["stage3_max_live_parameters"] * headroom / 2)
    assert small.value("offload_param.max_in_cpu") == int(SHARES["offload_param.max_in_cpu"] * headroom / 2)
    # the large budget: DeepSpeed's defaults (nothing needs more), and the write buffers at the largest shard
    assert large.value("reduce_bucket_size") == 2 * largest_shard(shape)
    assert large.value("offload_param.max_in_cpu") == DEEPSPEED["offload_param.max_in_cpu"]
    assert large.value("offload_optimizer.buffer_count") == DEEPSPEED["offload_optimizer.buffer_count"]
    assert large.value("offload_param.buffer_size") == largest_shard(shape)  # no buffer larger than a shard
    for key in ("stage3_max_live_parameters", "offload_param.max_in_cpu"):
        assert small.value(key) < large.value(key), key
    # a tiny budget: every key at its smallest, and the write buffers are pieces of the largest shard
    tiny = plan_sizes(64 * 2**20, shape, 2, config)
    assert tiny.value("reduce_bucket_size") == MIN_BUCKET and tiny.value("offload_param.max_in_cpu") == 0
    assert tiny.value("offload_optimizer.buffer_count") == 2 and tiny.value("offload_param.buffer_size") < largest_shard(shape)
    # what the resolved run needs stays within the budget whenever the headroom is not negative
    optimizer = probe_optimizer(config.optimizer)
    for plan in (small, large):
        memory = estimate_option(shape, plan.apply(config), 2, config_option(config), optimizer, "cpu")
        needed = memory.total("host") + memory.total("device") + sum(memory.transient.values())
        assert needed <= plan.budget or plan is large, (needed, plan.budget)
    # on a GPU the reduce buckets and gathered parameters are device memory: not sized from this host budget
    gpu = plan_sizes(2 * GiB, shape, 2, config, "cuda")
    assert gpu.value("reduce_bucket_size") is None and gpu.value("stage3_max_live_parameters") is None
    assert gpu.value("offload_param.max_in_cpu") is not None
    # the printed lines: the budget first, then one per key with its value and why
    lines = small.lines()
    assert lines[0].startswith("zerotrain memory budget: 2.00 GiB per rank") and len(lines) == 1 + 6
    assert "zero_optimization.offload_param.max_in_cpu = " in "\n".join(lines)


def test_a_key_the_user_sets_wins(shape):
    config = nvme_config(reduce_bucket_size=12345, offload_param={"max_in_cpu": 7, "buffer_count": 3})
    plan = plan_sizes(1 * GiB, shape, 2, config)
    assert plan.value("reduce_bucket_size") == 12345 and plan.value("offload_param.max_in_cpu") == 7
    assert plan.value("offload_param.buffer_count") == 3
    resolved = plan.apply(config)
    zero = resolved.zero_optimization
    assert zero.reduce_bucket_size == 12345 and zero.offload_param.max_in_cpu == 7
    # the unset ones were chosen, and the config still tells the user's keys from the chosen ones
    assert zero.stage3_max_live_parameters == plan.value("stage3_max_live_parameters") != DEEPSPEED[
        "stage3_max_live_parameters"]
    assert "stage3_max_live_parameters" not in zero.model_fields_set and "reduce_bucket_size" in zero.model_fields_set
    assert zero.stage3_fetch_limits()[0] == config.zero_optimization.stage3_fetch_limits()[0]


def test_a_run_that_cannot_fit_is_refused_with_the_numbers(shape):
    """The model with its optimizer in host memory (no offload, stage 2) at world 2 needs ~1 GiB per rank: refused
    under 256 MiB, naming the need, the limit and the largest consumers with their keys; accepted above."""
    config = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {}},
                          "zero_optimization": {"stage": 2}})
    plan = plan_sizes(256 * 2**20, shape, 2, config)
    memory = estimate_option(shape, plan.apply(config), 2, config_option(config), probe_optimizer(config.optimizer),
                             "cpu")
    with pytest.raises(ConfigError) as caught:
        check_fits(memory, 256 * 2**20, "zero_optimization.memory_budget_bytes")
    message = str(caught.value)
    assert "\n" not in message and "more than the 256.00 MiB there are (zero_optimization.memory_budget_bytes)" \
        in message, message
    assert "largest: optimizer_states" in message and "offload_optimizer.device: nvme" in message, message
    check_fits(memory, 4 * GiB, "plenty")  # fits: nothing raised


def test_a_clipped_run_over_its_budget_is_refused_and_the_spilled_one_fits(shape):
    """Clipping on (DeepSpeed's default 1.0), stage 3, parameters and optimizer on NVMe: with accumulation the
    gradient shards wait for the norm in host memory and the estimate counts them; without, the NVMe optimizer
    spills them to disk (#43) and it counts the spill instead. Under a budget between the two the held run is
    refused before any step, naming the gradients with the clipping keys and, with a share given, the budget
    that would let it run; the spilled run fits."""
    from zerotrain.budget import _host_bytes

    def resolved(accumulation: int, budget: int):
        raw = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
               "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/unused"},
                                     "offload_optimizer": {"device": "nvme", "nvme_path": "/unused"}}}
        config = load_config(raw)
        assert config.gradient_clipping == 1.0  # the default
        plan = plan_sizes(budget, shape, 2, config)
        return estimate_option(shape, plan.apply(config), 2, config_option(config),
                               probe_optimizer(config.optimizer), "cpu")

    budget = 600 * 2**20
    spilled, held = resolved(1, budget), resolved(2, budget)
    shards = 4 * sum(-(-p.numel // 2) for p in shape.params)  # the fp32 gradient shards of world 2
    assert spilled.rows["gradients"]["device"] == 0 and held.rows["gradients"]["device"] >= shards
    assert _host_bytes(spilled, "cpu") <= budget < _host_bytes(held, "cpu"), \
        (_host_bytes(spilled, "cpu") / 2**20, _host_bytes(held, "cpu") / 2**20)
    check_fits(spilled, budget, "the memory budget printed")  # fits: nothing raised
    with pytest.raises(ConfigError) as caught:
        check_fits(held, budget, "the memory budget printed", share=2 * budget)
    message = str(caught.value)
    assert "\n" not in message and "largest: gradients" in message and "gradient_clipping: 0" in message, message
    assert "spills them to disk" in message and f"memory_budget_bytes up to {2 * budget:,}" in message, message
    with pytest.raises(ConfigError) as caught:  # a share that would not help either: not offered
        check_fits(held, budget, "the memory budget printed", share=budget + 1)
    assert "memory_budget_bytes up to" not in str(caught.value)


def _cgroup(root, line: str, directory: str, limit: tuple[str, str], usage: tuple[str, int]) -> None:
    """A fake /proc/self/cgroup naming `directory`, with its limit and usage files."""
    (root / "proc/self/cgroup").write_text(line)
    folder = root / directory
    folder.mkdir(parents=True, exist_ok=True)
    (folder / limit[0]).write_text(f"{limit[1]}\n")
    (folder / usage[0]).write_text(f"{usage[1]}\n")


def test_the_refusals_advice_fits_the_runs_offload_device(shape, world_of_one):
    """The same model over the same budget, its optimizer on the CPU, on no offload and on NVMe with ratio 0.5:
    each refusal is one line whose advice for the masters and optimizer states says where they are now and
    what moves them (NVMe; bf16 masters and states where the CPU offload has them), once for both rows (#43: a
    CPU-offload run was told "offload_optimizer.device: nvme" after each row, as if that were its setting)."""
    def refusal(offload: dict, **extra) -> str:
        raw = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, **extra,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, "offload_optimizer": offload}}
        config = load_config(raw)
        plan = plan_sizes(256 * 2**20, shape, 2, config)
        memory = estimate_option(shape, plan.apply(config), 2, config_option(config),
                                 probe_optimizer(config.optimizer), "cpu")
        with pytest.raises(ConfigError) as caught:
            check_fits(memory, 64 * 2**20, "zero_optimization.memory_budget_bytes", config=plan.apply(config))
        message = str(caught.value)
        assert "\n" not in message and "largest: " in message, message
        return message

    cpu = refusal({"device": "cpu"})
    assert "host memory with zero_optimization.offload_optimizer.device cpu: zero_optimization.offload_optimizer" \
        ".device nvme puts them on disk or bf16.bf16_master_weights_and_grads + bf16.bf16_optimizer_states" in cpu, cpu
    assert cpu.count("puts them on disk") == 1 and "(the same)" in cpu, cpu
    assert "offload_optimizer.device: nvme" not in cpu, cpu
    # bf16 masters and states already: only NVMe is left to offer
    narrow = refusal({"device": "cpu"}, bf16={"enabled": True, "bf16_master_weights_and_grads": True,
                                              "bf16_optimizer_states": True})
    assert "device cpu: zero_optimization.offload_optimizer.device nvme puts them on disk" in narrow, narrow
    assert "bf16_optimizer_states (" not in narrow, narrow
    none = refusal({"device": "none"})
    assert "host memory with no zero_optimization.offload_optimizer: zero_optimization.offload_optimizer.device " \
        "nvme puts them on disk" in none and "bf16_master" not in none, none
    nvme = refusal({"device": "nvme", "nvme_path": "/unused", "ratio": 0.5})
    assert "zero_optimization.offload_optimizer.ratio: 1.0 (the part kept in host memory; 0.5 now)" in nvme, nvme
    # and where a run meets it: initialize refuses the CPU-offload run before any step with the same advice
    import zerotrain

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    raw = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": 3, "memory_budget_bytes": 10_000, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError) as caught:
        zerotrain.initialize(model=model, config=raw)
    assert "optimizer_states 1.00 MiB (host memory with zero_optimization.offload_optimizer.device cpu: " \
        "zero_optimization.offload_optimizer.device nvme puts them on disk or bf16" in str(caught.value), caught.value


def test_host_memory_reads_the_cgroup_limit(tmp_path):
    """cgroup v2: memory.max - memory.current wins over a larger MemAvailable; v1 the same with its files; no
    limit ("max") leaves MemAvailable."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text("MemTotal: 100 kB\nMemAvailable: 20971520 kB\n")  # 20 GiB
    _cgroup(tmp_path, "0::/job\n", "sys/fs/cgroup/job", ("memory.max", str(8 * GiB)), ("memory.current", 3 * GiB))
    found = host_memory_available(str(tmp_path))
    assert found.available == 5 * GiB and "cgroup v2" in found.source
    _cgroup(tmp_path, "0::/job\n", "sys/fs/cgroup/job", ("memory.max", "max"), ("memory.current", 3 * GiB))
    assert host_memory_available(str(tmp_path)).available == 20 * GiB
    _cgroup(tmp_path, "4:memory:/job1\n", "sys/fs/cgroup/memory/job1", ("memory.limit_in_bytes", str(4 * GiB)),
            ("memory.usage_in_bytes", GiB))
    found = host_memory_available(str(tmp_path))
    assert found.available == 3 * GiB and "cgroup v1" in found.source
    assert default_budget(8 * GiB, 2, own=GiB) == int(0.5 * 5 * GiB)
    assert host_memory_available().available > 0  # this machine's


def test_the_plan_is_printed_once_per_process_on_rank_0_and_not_when_every_key_is_set(shape, capsys, monkeypatch):
    from zerotrain import budget

    monkeypatch.setattr(budget, "_announced", [False])
    chosen = plan_sizes(2 * GiB, shape, 2, nvme_config())
    all_set = plan_sizes(2 * GiB, shape, 2, nvme_config(reduce_bucket_size=MIN_BUCKET, stage3_max_live_parameters=10**8,
                                                        offload_param={"max_in_cpu": 0, "buffer_count": 2,
                                                                       "buffer_size": MIN_BUCKET},
                                                        offload_optimizer={"buffer_count": 2}))
    assert all(c.user for c in all_set.choices) and not all(c.user for c in chosen.choices)
    assert not budget.announce(all_set, 0)  # nothing chosen: nothing to say (and the one print is still due)
    assert not budget.announce(chosen, 1)  # not rank 1
    assert capsys.readouterr().err == ""
    assert budget.announce(chosen, 0)
    assert capsys.readouterr().err.splitlines() == chosen.lines()
    assert not budget.announce(chosen, 0)  # a second engine of the process: silent
    assert capsys.readouterr().err == ""


def test_zerotrain_estimate_sizes_the_unset_keys_by_the_budget():
    """`zerotrain estimate` (estimate(..., sizes=estimate_sizes)) reports the sizes the engine would choose under the
    config's budget, and estimates the run with them: a small and a large budget give different host buffers."""
    from zerotrain.budget import estimate_sizes
    from zerotrain.estimate import estimate

    raw = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/unused"},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": "/unused"}}}
    results = {}
    for budget in (512 * 2**20, 8 * GiB):
        raw["zero_optimization"]["memory_budget_bytes"] = budget
        result = estimate("70m", raw, 2, device_type="cpu", sizes=estimate_sizes)
        meta, _ = load_meta_model("70m", torch.bfloat16)
        config = load_config(raw, dp_world_size=2)
        resolved, plan = estimate_sizes(model_shape(meta), config, 2, "cpu", probe_optimizer(config.optimizer))
        assert result["memory_budget"] == plan.lines(), result["memory_budget"]
        own = next(o for o in result["options"] if o["option"] == result["config_option"])
        expected = estimate_option(model_shape(meta), resolved, 2, config_option(resolved),
                                   probe_optimizer(config.optimizer), "cpu")
        assert own["rows"] == expected.as_dict()["rows"]
        results[budget] = own["rows"]["host_io_buffers"]["host"]  # the NVMe stores' buffers
    assert results[512 * 2**20] < results[8 * GiB], results
    plain = estimate("70m", raw, 2, device_type="cpu")  # without sizes: DeepSpeed's defaults, no budget lines
    assert "memory_budget" not in plain


def test_a_4_gib_budget_holds_at_every_size_of_the_issue():
    """Issue #27's sizes as `benchmarks/scale.py --defaults --budget 4GiB` runs them (world 2, B=1, T=64, bf16, NVMe
    parameters and optimizer, no size key, clipping 1.0, no activation checkpointing): GPT 0.24B, 1B, 2.4B, 4B and the 7B
    Llama with bf16 records. The estimate's per-rank host peak under the sizes the budget chooses (`zerotrain
    estimate`'s accounting: states in memory + activations + transient step buffers), plus the runtime (Python,
    torch, gloo: measured 0.30-0.34 GiB per rank), stays under 4 GiB at every size, and from 1B up it does not
    grow with the parameters (the measured peaks are in benchmarks/RESULTS_scale.md)."""
    import math

    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotrain.budget import estimate_sizes
    from zerotrain.estimate import device_peak, estimate
    from zerotrain.models import GPT, GPTConfig

    vocab, runtime = 50304, 0.4 * GiB

    def config(narrow: bool) -> dict:
        nvme = {"device": "nvme", "nvme_path": "/unused"}
        bf16 = dict(enabled=True, bf16_master_weights_and_grads=narrow, bf16_optimizer_states=narrow)
        # no gradient_clipping key: DeepSpeed's default 1.0, the gradients spilled to disk (#43; with it 0 the
        # estimate is the same less the spill's buffers)
        return {"train_micro_batch_size_per_gpu": 1, "bf16": bf16,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "zero_optimization": {"stage": 3, "offload_param": dict(nvme), "offload_optimizer": dict(nvme),
                                      "memory_budget_bytes": 4 * GiB}}

    peaks, params = {}, {}
    with torch.device("meta"):
        models = {f"gpt {layers}x{width}": GPT(GPTConfig(vocab_size=vocab, n_layer=layers, n_head=width // 128,
                                                         n_embd=width, block_size=64, bias=True))
                  for layers, width in ((9, 1280), (18, 2048), (24, 2816), (29, 3328))}
        models["llama 32x4096"] = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=4096, intermediate_size=int(math.ceil(8 * 4096 / 3 / 256) * 256),
            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=128,
            tie_word_embeddings=False, use_cache=False))
    for name, model in models.items():
        result = estimate(model.to(torch.bfloat16), config(name.startswith("llama")), 2, device_type="cpu",
                          seq_len=64, micro_batch=1, sizes=estimate_sizes)
        own = next(o for o in result["options"] if o["option"] == result["config_option"])
        activations = dict(result["activations"], with_checkpointing=result["activations"]["without_checkpointing"])
        peaks[name] = device_peak(own, activations) + own["totals"]["host"]
        params[name] = result["parameters"]
        assert result["memory_budget"][0].startswith("zerotrain memory budget: 4.00 GiB per rank"), result
    assert all(peak + runtime <= 4 * GiB for peak in peaks.values()), {k: v / GiB for k, v in peaks.items()}
    one, four = peaks["gpt 18x2048"], peaks["gpt 29x3328"]
    assert params["gpt 29x3328"] > 3.9 * params["gpt 18x2048"]
    assert four < 1.2 * one, (one / GiB, four / GiB)  # 4x the parameters, < 1.2x the memory (estimated 1.14x)


def test_initialize_of_a_model_not_from_transformers_imports_none_of_it():
    """Importing transformers costs every rank ~70 MiB of RSS (and pulls accelerate, scipy, huggingface_hub): a rank
    training zerotrain's GPT at pipeline_parallel_size 1 must not pay it (issue #27: with it, ZeRO-3's peak on a
    small model sat ~64 MiB above FSDP2's). A fresh interpreter: the test processes' forkserver preloads it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import json, sys, torch, zerotrain\n"
        "from zerotrain.models import GPT, GPTConfig\n"
        "engine, *_ = zerotrain.initialize(model=GPT(GPTConfig.preset('tiny')), config={\n"
        "    'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},\n"
        "    'zero_optimization': {'stage': 3}})\n"
        "x = torch.randint(0, 256, (2, 8))\n"
        "engine.backward(engine(x, x)[1]); engine.step()\n"
        "print(json.dumps(sorted(m for m in ('transformers', 'accelerate', 'scipy') if m in sys.modules)))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    root = str(Path(__file__).resolve().parent.parent)
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], done.stdout


def test_the_budget_refuses_or_brings_under_at_its_boundary(world_of_one, monkeypatch):
    """`resolve_memory` (what every engine build calls first) at the budget's boundary, in-process at ZeRO world 1
    on a node said to run 2 ranks. Without `memory_budget_bytes` the budget is DEFAULT_FRACTION of (the host
    memory available / the ranks on the node + this rank's resident bytes): with every size key unset, a budget
    of exactly what the run needs at the smallest sizes (`plan.states`) is accepted, every key brought down to
    its smallest; one byte less is refused before anything is built, naming the printed budget and offering
    `memory_budget_bytes` up to the rank's share. With every size key set and `memory_budget_bytes` given, a
    need equal to the budget is accepted and one byte over it refused (no share offered: the user set it). An
    unknown host memory (nothing read, nothing resident) refuses nothing."""
    import dataclasses

    import zerotrain.budget as budget_module
    from zerotrain.budget import HostMemory, resolve_memory
    from zerotrain.comm import Comm
    from zerotrain.topology import Topology

    own = 300 * 2**20  # this rank's resident bytes, as /proc/self/statm would give them
    monkeypatch.setattr(budget_module, "_own_rss", lambda root="/": own)
    topology = Topology.build(timeout_seconds=60)
    comm = Comm.data_parallel(topology)
    node_of_two = dataclasses.replace(topology, ranks_per_node=2)
    model, _ = load_meta_model("tiny", torch.bfloat16)  # on the meta device: the runtime is all of `own`
    shape = model_shape(model)

    def resolve(config, available: int):
        return resolve_memory(model, config, node_of_two, comm, HostMemory(available, "MemAvailable"))

    # every size key unset, no budget key: the default budget
    config = nvme_config()
    states = plan_sizes(GiB, shape, 1, config, runtime=own).states  # the need at the smallest sizes
    assert states > own
    fitted = resolve(config, 2 * (2 * states - own))  # 50% of (available / 2 + own) == states, to the byte
    zero = fitted.zero_optimization
    assert (zero.reduce_bucket_size, zero.offload_param.max_in_cpu, zero.offload_param.buffer_count,
            zero.offload_optimizer.buffer_count) == (MIN_BUCKET, 0, 1, 2), zero
    with pytest.raises(ConfigError) as caught:
        resolve(config, 2 * (2 * states - 2 - own))  # the default budget is states - 1
    message = str(caught.value)
    assert "\n" not in message and f"more than the {format_bytes(states - 1)} there are (the memory budget " \
        "printed: 50% of" in message and "MemAvailable / 2 ranks on the node" in message, message
    assert f"memory_budget_bytes up to {2 * states - 2:,}" in message, message  # the share: available / 2 + own
    # every size key set, budget given: the need is fixed
    sized = {"reduce_bucket_size": MIN_BUCKET, "stage3_max_live_parameters": 10**9,
             "offload_param": {"max_in_cpu": 1000, "buffer_count": 2, "buffer_size": 4096},
             "offload_optimizer": {"buffer_count": 3}}
    need = plan_sizes(GiB, shape, 1, nvme_config(**sized), runtime=own).states
    assert resolve(nvme_config(**sized, memory_budget_bytes=need), GiB).zero_optimization.reduce_bucket_size == \
        MIN_BUCKET
    with pytest.raises(ConfigError) as caught:
        resolve(nvme_config(**sized, memory_budget_bytes=need - 1), 64 * GiB)
    message = str(caught.value)
    assert f"more than the {format_bytes(need - 1)} there are (zero_optimization.memory_budget_bytes)" in message
    assert "memory_budget_bytes up to" not in message, message
    monkeypatch.setattr(budget_module, "_own_rss", lambda root="/": 0)
    resolve(nvme_config(**sized), 0)  # no memory known: nothing to hold the run to


def test_a_loads_second_copy_may_take_the_default_budgets_share_of_the_memory_available_now(world_of_one):
    """`load_copy_allowance`: DEFAULT_FRACTION of the host memory available over the ranks on the node (tensor-
    parallel ranks counted), the default budget's rule, taken when the load runs."""
    import dataclasses

    from zerotrain.budget import DEFAULT_FRACTION, HostMemory, load_copy_allowance, ranks_on_node
    from zerotrain.topology import Topology

    topology = Topology.build(timeout_seconds=60)
    node_of_three = dataclasses.replace(topology, ranks_per_node=3)
    available = 12 * GiB + 5
    assert ranks_on_node(node_of_three) == 3 and ranks_on_node(dataclasses.replace(node_of_three, tp_size=2)) == 6
    assert ranks_on_node(dataclasses.replace(topology, ranks_per_node=0, dp_size=4)) == 4  # not known: every ZeRO rank
    assert ranks_on_node(dataclasses.replace(topology, ranks_per_node=1)) == 1
    assert load_copy_allowance(topology) > 0  # this machine's memory, read now
    assert load_copy_allowance(node_of_three, HostMemory(available, "MemAvailable")) == \
        int(DEFAULT_FRACTION * (available // 3)) == 2 * GiB
    assert load_copy_allowance(dataclasses.replace(node_of_three, tp_size=2), HostMemory(available, "x")) == GiB
    assert load_copy_allowance(node_of_three, HostMemory(0, "unknown")) == 0


def test_the_sizes_floor_and_cap_at_their_exact_values():
    """Exact values where the plan's rules switch: with no headroom, `stage3_max_live_parameters` is the two
    largest modules' non-persistent parameters (padded to the ranks; a bias of at most the persistence
    threshold stays whole on every rank and is not gathered), and with a vast budget a shard larger than
    DeepSpeed's `offload_param.buffer_size` (1e8 elements) is written through buffers of exactly 1e8."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 999), torch.nn.Linear(999, 10))
    floor = plan_sizes(1, model_shape(model), 2, nvme_config())  # no headroom: every unset key at its smallest
    assert floor.value("stage3_max_live_parameters") == 1000 * 1000 + 999 * 1000  # weights only (biases persist)
    wide, _ = load_meta_model("70m", torch.bfloat16, layers=1, width=8448)  # MLP weights of 285M elements
    shape = model_shape(wide)
    assert largest_shard(shape) > DEEPSPEED["offload_param.buffer_size"]
    vast = plan_sizes(2**40, shape, 2, nvme_config())
    assert vast.value("offload_param.buffer_size") == 100_000_000
    assert vast.value("offload_param.buffer_count") == DEEPSPEED["offload_param.buffer_count"]


def test_runtime_counts_a_shared_storage_once_and_own_rss_is_this_process():
    """The runtime is this rank's resident bytes less the model's host tensors, a tied weight counted once; the
    resident bytes are read from /proc/self/statm (this process's, as /proc/self/status says)."""
    from zerotrain.budget import _own_rss, runtime_bytes

    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    model[1].weight = model[0].weight  # tied: one 400-byte storage, two biases of 40 bytes
    assert runtime_bytes(model, 10**6) == 10**6 - 400 - 40 - 40
    flat = torch.zeros(30)  # two parameters and a buffer, views of one 120-byte storage (as flat buckets make them)
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Parameter(flat[:10]), torch.nn.Parameter(flat[10:25])
    model.register_buffer("c", flat[25:])
    assert runtime_bytes(model, 10**6) == 10**6 - 120
    with open("/proc/self/status") as handle:
        vm_rss = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS:"))
    assert abs(_own_rss() - vm_rss) < 64 * 2**20, (_own_rss(), vm_rss)


def test_the_first_pass_keeps_its_activations_out_of_the_parameter_cache(tmp_path, world_of_one, monkeypatch,
                                                                         capsys):
    """Issue #43: a CPU run whose clip takes the norm from a first backward (NVMe parameters and optimizer,
    clipping, `max_in_cpu` left to the budget) holds the micro-batch's activations back from the parameter cache
    before each first pass: exactly the bytes plain PyTorch's forward saves (parameters left out), the largest
    micro-batch's so far; the cache evicts down to `max_in_cpu` less them at once; rank 0 says so once. The
    training is the same, bit for bit, as with that `max_in_cpu` set by the user, which keeps the whole cache
    (no reserve); the spill (`norm_first_pass: false`) has none either."""
    import copy

    import zerotrain
    import zerotrain.budget as budget_module
    from zerotrain.models import GPT, GPTConfig
    from models_for_tests import saved_activation_bytes

    monkeypatch.setattr(budget_module, "_own_rss", lambda root="/": 300 * 2**20)  # the runtime, fixed
    monkeypatch.setattr(budget_module, "_announced", [True])  # (the plan's lines: not this test's)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=128, block_size=32, tie_weights=False))
    lengths = (8, 8, 16, 4)  # a longer micro-batch keeps more; a shorter one changes nothing
    batches = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    saved = [saved_activation_bytes(lambda ids=ids, copied=copy.deepcopy(model): copied(ids, ids)) for ids in batches]
    assert saved[2] > saved[0] > saved[3] > 0

    def run(name: str, **offload) -> dict:
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "steps_per_print": 0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "memory_budget_bytes": 305 * 2**20,
                                        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / name),
                                                              **offload.pop("optimizer", {})},
                                        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / name),
                                                          **offload}}}
        engine, *_ = zerotrain.initialize(model=copy.deepcopy(model), config=config)
        store, out = engine.parts.param_store, {"losses": [], "held": [], "bound": [], "cached_before": [],
                                                "cached_after": []}
        out["max_in_cpu"], out["reserve"] = store.max_in_cpu, engine.first_pass_reserve is not None
        for ids in batches:
            loss = engine(ids, ids)[1]
            out["cached_before"].append(store.cached_numel)
            engine.backward(loss)
            out["held"].append(engine.first_pass_reserve.held if out["reserve"] else None)
            out["bound"].append(store._cache_bound())
            out["cached_after"].append(store.cached_numel)
            engine.step()
            out["losses"].append(float(loss.detach()))
        out["weights"], out["stats"] = engine.full_state_dict(), engine.offload_stats()
        out["stderr"] = capsys.readouterr().err
        engine.close()
        return out

    reserved = run("reserved")
    assert reserved["reserve"] and reserved["stats"]["norm_first_passes"] == len(lengths)
    assert reserved["held"] == [saved[0], saved[0], saved[2], saved[2]]
    assert reserved["max_in_cpu"] * 4 > saved[2], reserved  # the cache is large enough to give them up
    for held, bound, before, after in zip(reserved["held"], reserved["bound"], reserved["cached_before"],
                                          reserved["cached_after"]):
        assert bound == reserved["max_in_cpu"] - -(-held // 4) and after <= bound
    assert reserved["cached_before"][0] > reserved["bound"][0]  # the forward filled more than the first pass keeps
    lines = [line for line in reserved["stderr"].splitlines() if "first backward keeps" in line]
    assert len(lines) == 1 and f"activations ({format_bytes(saved[0])}, counted" in lines[0] and \
        f"max_in_cpu holds {format_bytes(reserved['bound'][0] * 4)} from now on" in lines[0], reserved["stderr"]
    kept = run("kept", max_in_cpu=reserved["max_in_cpu"])  # the user's key: the whole cache, no line
    assert not kept["reserve"] and kept["bound"] == [kept["max_in_cpu"]] * len(lengths)
    assert "first backward keeps" not in kept["stderr"]
    assert kept["losses"] == reserved["losses"]
    for name, value in kept["weights"].items():
        assert torch.equal(reserved["weights"][name], value), name
    spilled = run("spilled", optimizer={"norm_first_pass": False})
    assert not spilled["reserve"] and spilled["stats"]["norm_first_passes"] == 0
    assert spilled["losses"] == reserved["losses"] and "first backward keeps" not in spilled["stderr"]


def test_the_first_pass_reserve_is_built_only_where_the_cache_can_give_way(tmp_path, world_of_one, capsys):
    """`first_pass_reserve`: only for an engine that takes the norm from a first pass, with its parameters in an
    NVMe store whose `max_in_cpu` the budget chose, on a CPU run (on a GPU the activations are device memory, the
    cache host memory); `FirstPassReserve.hold` holds back the largest activations so far and only rank 0 prints,
    once."""
    import dataclasses

    from zerotrain.budget import FirstPassReserve, first_pass_reserve
    from zerotrain.offload.param_store import HostParamStore, NvmeParamStore
    from zerotrain.topology import Topology

    topology = Topology.build(timeout_seconds=60)
    nvme = NvmeParamStore([], str(tmp_path), rank=0, buffer_count=1, buffer_size=1024, max_in_cpu=1000)
    try:
        chosen, user_set = nvme_config(), nvme_config(offload_param={"max_in_cpu": 1000})
        assert isinstance(first_pass_reserve(chosen, nvme, True, topology), FirstPassReserve)
        assert first_pass_reserve(chosen, nvme, False, topology) is None  # the spill, or no clipping
        assert first_pass_reserve(user_set, nvme, True, topology) is None
        assert first_pass_reserve(chosen, None, True, topology) is None
        assert first_pass_reserve(chosen, HostParamStore([]), True, topology) is None  # no cache to give
        on_gpu = dataclasses.replace(topology, device=torch.device("cuda", 0))
        assert first_pass_reserve(chosen, nvme, True, on_gpu) is None
        rank1 = FirstPassReserve(nvme, rank=1)  # (a store without shards counts its cache in bytes)
        bounds = []
        for nbytes in (400, 400, 800, 100):
            rank1.hold(nbytes)
            bounds.append(nvme._cache_bound())
        assert bounds == [600, 600, 200, 200] and rank1.held == 800  # the largest so far, not the latest
        assert capsys.readouterr().err == ""  # rank 1 prints nothing
        nvme.hold_back_cache(0)
        rank0 = FirstPassReserve(nvme, rank=0)
        rank0.hold(0)  # nothing saved (a forward under no_grad): nothing to hold back, nothing said
        assert nvme._cache_bound() == 1000 and capsys.readouterr().err == ""
        rank0.hold(400)
        rank0.hold(800)
        err = capsys.readouterr().err
        assert nvme._cache_bound() == 200 and err.count("\n") == 1 and "(400 B, counted in its forward)" in err \
            and "max_in_cpu holds 600 B from now on" in err, err
    finally:
        nvme.close()
