"""FP8 memory (issue #49): the estimate's float8 sizes against measured peaks, emulated on the CPU.

    PYTHONPATH=. python benchmarks/fp8_memory.py [--json out.json]

Two tables, both counted in bytes of tensors (torch's profiler records every CPU allocation and free with its
size; the peak is the running sum's maximum over forward and backward): deterministic on a loaded machine, no
timing involved, no RSS noise.

1. Per layer: a `Float8Linear` (torchao, emulated) against an `nn.Linear` of the same shape, M tokens; the measured
   extra peak of its forward and of its backward vs `zerotrain.fp8.fp8_layer_bytes` (tensorwise and rowwise).
2. A Llama-shaped model (transformers' LlamaForCausalLM, fp32) trained by the engine (world 1, ZeRO-0, AdamW): the
   whole run's peak (model, engine, two steps) without fp8, tensorwise, rowwise, each with and without activation
   checkpointing, against `zerotrain estimate`'s peak (`estimate.device_peak` + host bytes) for the same config.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYER_SHAPES = [(512, 256, 704), (256, 512, 256), (1024, 128, 384), (64, 1024, 512), (128, 128, 1024),
                (1024, 512, 128), (32, 512, 512), (512, 64, 64), (2048, 256, 768)]  # (M tokens, in, out)
LLAMA = dict(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
MICRO, SEQ = 2, 256


def measured_peak(fn) -> int:
    """The peak of live tensor bytes allocated inside `fn()` (CPU allocator events from torch's profiler; an
    event's own allocations counted at its start, its own frees at its end)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        fn()
    events = [e for e in prof.events() if e.self_cpu_memory_usage]
    events.sort(key=lambda e: e.time_range.start if e.self_cpu_memory_usage > 0 else e.time_range.end)
    live = peak = 0
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _convert(model: torch.nn.Module, recipe: str, names=None) -> None:
    from torchao.float8 import convert_to_float8_training

    from zerotrain.fp8 import fp8_plan, torchao_config

    chosen = set(fp8_plan(model).converted if names is None else names)
    convert_to_float8_training(model, config=torchao_config(recipe, emulate=True),
                               module_filter_fn=lambda module, name: name in chosen)


def layer_rows() -> list[dict]:
    from zerotrain.fp8 import fp8_layer_bytes

    rows = []
    for m, k, n in LAYER_SHAPES:
        base = None
        for recipe in (None, "tensorwise", "rowwise"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
            if recipe:
                _convert(model, recipe, names=["0"])
            x = torch.randn(m, k, requires_grad=True)
            out = {}
            forward = measured_peak(lambda: out.setdefault("y", model(x)))
            backward = measured_peak(lambda: out["y"].backward(torch.ones_like(out["y"])))
            if recipe is None:
                base = (forward, backward)
                continue
            est = fp8_layer_bytes(m, k, n, recipe, emulate=True, dtype_bytes=4)
            rows.append({"shape": f"{m}x{k}->{n}", "recipe": recipe,
                         "forward_measured": forward - base[0], "forward_estimate": est["forward"],
                         "backward_measured": backward - base[1], "backward_estimate": est["backward"]})
    return rows


def step_config(recipe, checkpointing: bool, micro: int = MICRO) -> dict:
    """The engine's config of a whole-step row: world 1, ZeRO-0, fp32, AdamW, DeepSpeed's other defaults."""
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0},
              "fp8": {"enabled": recipe is not None, "recipe": recipe or "tensorwise"}}
    if checkpointing:
        config["activation_checkpointing"] = {}
    return config


def step_row(recipe, checkpointing: bool, dims: dict = LLAMA, micro: int = MICRO, seq: int = SEQ,
             steps: int = 2) -> dict:
    """One whole-step row: the peak of live tensor bytes from building a transformers `LlamaForCausalLM` through
    `steps` engine steps (zerotrain.initialize, world 1; everything the run holds: parameters, gradients,
    optimizer states, activations, float8 casts), against `zerotrain estimate`'s peak for the same model and
    config (`device_peak` of the config's option + its host bytes; activations without checkpointing where the
    run checkpoints nothing, as benchmarks/zero_speed_memory.py does)."""
    import transformers

    import zerotrain
    from zerotrain.checkpointing import enable_hf_gradient_checkpointing
    from zerotrain.config import load_config
    from zerotrain.estimate import config_option, device_peak, estimate

    config = step_config(recipe, checkpointing, micro)
    ids = torch.randint(0, dims["vocab_size"], (micro, seq), generator=torch.Generator().manual_seed(0))

    def run() -> None:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims))
        if checkpointing:
            enable_hf_gradient_checkpointing(model)  # (transformers' own switch, with zerotrain's checkpoint)
        engine, *_ = zerotrain.initialize(model=model, config=config)
        for _ in range(steps):
            engine.backward(engine(input_ids=ids, labels=ids, use_cache=False).loss)
            engine.step()
    measured = measured_peak(run)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims))
    result = estimate(meta, config, world_size=1, options=[config_option(load_config(config))], device_type="cpu",
                      seq_len=seq, micro_batch=micro)
    option, acts = result["options"][0], dict(result["activations"])
    if not checkpointing:
        acts["with_checkpointing"] = acts["without_checkpointing"]
    estimated = device_peak(option, acts) + option["totals"]["host"]
    return {"recipe": recipe or "none (fp32)", "checkpointing": checkpointing, "measured": measured,
            "estimate": estimated, "states": option["totals"]["device"], "activations": acts["with_checkpointing"],
            "fp8_transient": acts["fp8_transient"],
            "largest_layer": (result.get("fp8") or {}).get("largest_layer")}


def step_rows() -> list[dict]:
    return [step_row(recipe, checkpointing) for checkpointing in (False, True)
            for recipe in (None, "tensorwise", "rowwise")]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--layers-only", action="store_true", help="the per-layer table only")
    args = parser.parse_args(argv)
    layers = layer_rows()
    print("| layer (M x in -> out) | recipe | forward measured MiB | estimate | ratio | backward measured MiB | "
          "estimate | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in layers:
        print(f"| {r['shape']} | {r['recipe']} | {_mib(r['forward_measured'])} | {_mib(r['forward_estimate'])} | "
              f"{r['forward_estimate'] / r['forward_measured']:.3f} | {_mib(r['backward_measured'])} | "
              f"{_mib(r['backward_estimate'])} | {r['backward_estimate'] / r['backward_measured']:.3f} |")
    models = [] if args.layers_only else step_rows()
    if models:
        print()
        print(f"| Llama {LLAMA['hidden_size']}x{LLAMA['num_hidden_layers']}, {MICRO}x{SEQ} tokens, fp32, ZeRO-0 | "
              "activation checkpointing | measured peak MiB | estimate MiB | estimate / measured | states MiB | "
              "activations MiB | fp8 transient MiB (largest layer) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in models:
            print(f"| {r['recipe']} | {'yes' if r['checkpointing'] else 'no'} | {_mib(r['measured'])} | "
                  f"{_mib(r['estimate'])} | {r['estimate'] / r['measured']:.3f} | {_mib(r['states'])} | "
                  f"{_mib(r['activations'])} | {_mib(r['fp8_transient'])} ({r['largest_layer']}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": layers, "model": models}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
