"""FP8 memory (issue #49): the estimate's float8 sizes against measured peaks, emulated on the CPU.

    PYTHONPATH=. python benchmarks/fp8_memory.py [--json out.json]

Two tables, both counted in bytes of tensors (torch's profiler records every CPU allocation and free with its
size; the peak is the running sum's maximum over forward and backward): deterministic on a loaded machine, no
timing involved, no RSS noise.

1. Per layer: a `Float8Linear` (torchao, emulated) against an `nn.Linear` of the same shape, M tokens; the measured
   extra peak of its forward and of its backward vs `zerotrain.fp8.fp8_layer_bytes` (tensorwise and rowwise).
2. A Llama-shaped model (transformers' LlamaForCausalLM, fp32): forward + backward of one micro-batch, without fp8,
   tensorwise, rowwise: the measured peak vs the estimate's (`zerotrain.estimate`'s activations without
   checkpointing + the gradients + the fp8 transient).
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


def model_rows() -> list[dict]:
    import transformers

    from zerotrain.estimate import estimate

    rows = []
    ids = torch.randint(0, LLAMA["vocab_size"], (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    for recipe in (None, "tensorwise", "rowwise"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
        if recipe:
            _convert(model, recipe)

        def step():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        step()  # warm (lazy initializations)
        model.zero_grad(set_to_none=True)
        peak = measured_peak(step)
        grads = sum(p.numel() * p.element_size() for p in model.parameters())
        config = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                  "fp8": {"enabled": recipe is not None, "recipe": recipe or "tensorwise"}}
        with torch.device("meta"):
            meta = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
        result = estimate(meta, config, world_size=1, device_type="cpu", seq_len=SEQ, micro_batch=MICRO)
        acts = result["activations"]
        estimated = acts["without_checkpointing"] + grads + acts["fp8_transient"]
        rows.append({"recipe": recipe or "none (fp32)", "measured": peak, "estimate": estimated,
                     "activations": acts["without_checkpointing"], "gradients": grads,
                     "fp8_transient": acts["fp8_transient"], "largest_layer": (result.get("fp8") or {}).get("largest_layer")})
    return rows


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
    models = [] if args.layers_only else model_rows()
    if models:
        print()
        print(f"| Llama {LLAMA['hidden_size']}x{LLAMA['num_hidden_layers']}, {MICRO}x{SEQ} tokens, fp32 | measured "
              "peak MiB | estimate MiB | estimate / measured | of which fp8 transient MiB (largest layer) |")
        print("|---|---|---|---|---|")
        for r in models:
            print(f"| {r['recipe']} | {_mib(r['measured'])} | {_mib(r['estimate'])} | "
                  f"{r['estimate'] / r['measured']:.3f} | {_mib(r['fp8_transient'])} ({r['largest_layer']}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": layers, "model": models}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
