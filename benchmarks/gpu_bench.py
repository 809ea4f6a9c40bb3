"""The GPU session's benchmark table (benchmarks/gpu_check.py runs it after tests/gpu; RESULTS_gpu.md records it).

    python benchmarks/gpu_bench.py --device cuda --out DIR --budget 140     # on one H100 / H200
    python benchmarks/gpu_bench.py --device cpu --tiny --out DIR             # the dry run: same code, tiny models

Parts, each in its own process under its share of `--budget` (a part that runs out is killed and recorded so;
parts later in the list that no longer fit are recorded as not run). Each appends one JSON line to
`bench.jsonl` as it ends; `bench.md` is the table.

- `matmul`: the measured bf16 matrix-product rate (8192^3, median of 10 after warm-up): the ceiling MFU is read
  against beside the datasheet's dense bf16 peak (989 TFLOP/s for H100 / H200 SXM).
- `zt_llama` / `hf_ds_llama`: an HF LlamaForCausalLM of ~1.0B parameters (hidden 2048, 20 layers, GQA 32/8 heads,
  vocab 32000), bf16 with fp32 masters, ZeRO-3 at world 1, activation checkpointing on every layer, AdamW
  (torch's), micro-batch 8 x 1024 tokens of random ids, 2 warm-up + 5 timed steps; zerotrain's engine loop
  against `transformers.Trainer` with a DeepSpeed ZeRO-3 config (`torch_adam`, so no compiled DeepSpeed op;
  the model built under DeepSpeed's zero.Init by `from_config`, as the Trainer's users do). tokens/s from the
  median step; MFU = model FLOPs (6 N + 12 L d s per token: the recompute is not counted) / step time / peak.
  If DeepSpeed cannot be imported there, the row says why and the column is empty.
- `offload`: a ~0.5B Llama (hidden 1536, 12 layers), bf16, ZeRO-3, optimizer states on the CPU (pinned):
  plain offload against SuperOffload (speculative CPU Adam overlapping backward); step time (forward + backward
  + step, synchronized), the ratio super / plain (the seed's claim: <= 0.8).
- `nvme`: a fixed 0.45B Llama (the `offload` part's shape, 4 x 512 tokens), bf16, ZeRO-3 with optimizer states
  AND parameters on NVMe (O_DIRECT where the folder takes it): the seconds of two steps (the first reads the
  states written at start; ~5.4 GB of fp32 states read and written per step, sized for the five-minute run on a
  disk of unknown speed), with the offload counters. `--nvme-size llama11b` (TinyLlama's 1.1B shape, ~13 GB of
  states) is the larger rerun when minutes are left.
- `fp8`: the `offload` part's 0.5B Llama on the device, bf16, ZeRO-3 at world 1, without and with the `fp8` block
  (torchao tensorwise; emulated off an fp8 GPU, as the engine's line says): tokens/s and peak memory of each, their
  ratios (fp8 / bf16), the same losses within float8's error, and `zerotrain estimate`'s fp8 transient for the
  shape against the measured peak difference (docs/fp8.md). Without torchao the row says so.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARTS = ("matmul", "zt_llama", "hf_ds_llama", "offload", "nvme", "fp8")
SHARES = {"matmul": 0.06, "zt_llama": 0.24, "hf_ds_llama": 0.28, "offload": 0.22, "nvme": 0.20,
          "fp8": 0.16}  # weights of --budget
DATASHEET_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12}
SIZES = {  # name -> LlamaConfig fields, micro-batch, sequence, warm-up steps, timed steps
    "llama1b": (dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=32000), 8, 1024, 2, 5),
    "llama05b": (dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=24,
                      num_key_value_heads=8, vocab_size=32000), 16, 1024, 1, 3),
    "llama05b_nvme": (dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=24,
                           num_key_value_heads=8, vocab_size=32000), 4, 512, 0, 2),
    "llama11b": (dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000), 4, 512, 0, 2),
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256), 2, 32, 1, 2),
}
PART_SIZE = {"zt_llama": "llama1b", "hf_ds_llama": "llama1b", "offload": "llama05b", "nvme": "llama05b_nvme",
             "fp8": "llama05b"}


# --- shared pieces ---------------------------------------------------------------------------------------------
def _size(args, part: str):
    name = "tiny" if args.tiny else (args.nvme_size if part == "nvme" and args.nvme_size else PART_SIZE[part])
    fields, micro, seq, warmup, timed = SIZES[name]
    return fields, micro, seq, warmup, timed


def _llama_config(fields: dict, seq: int):
    from transformers import LlamaConfig
    return LlamaConfig(**fields, max_position_embeddings=max(seq, 64), use_cache=False, tie_word_embeddings=False)


def _batches(vocab: int, micro: int, seq: int, steps: int):
    import torch
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (micro, seq), generator=generator) for _ in range(steps)]


def _sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_gib(device: str) -> float | None:
    import torch
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


def _model_flops_per_token(config, seq: int) -> float:
    """6 N (every weight's multiply-add, forward + backward; the embedding lookup is no product) + 12 L d s
    (attention scores and values, PaLM's convention)."""
    d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    kv = d * config.num_key_value_heads // config.num_attention_heads
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * config.intermediate_size
    weights = layers * per_layer + d * vocab  # the head; the input embedding is a lookup
    return 6 * weights + 12 * layers * d * seq


def _n_params(config) -> int:
    d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    kv = d * config.num_key_value_heads // config.num_attention_heads
    return layers * (d * d * 2 + d * kv * 2 + 3 * d * config.intermediate_size + 2 * d) + 2 * d * vocab + d


def _throughput(times: list, tokens: int, config, seq: int, device: str, peak: float | None) -> dict:
    step = statistics.median(times)
    flops = _model_flops_per_token(config, seq) * tokens / step
    return {"step_s": round(step, 4), "steps_s": [round(t, 4) for t in times], "tokens_per_s": round(tokens / step, 1),
            "model_tflops": round(flops / 1e12, 2), "mfu": round(flops / peak, 4) if peak else None,
            "params": _n_params(config), "peak_gib": _peak_gib(device)}


def _datasheet_peak(device: str) -> float | None:
    import torch
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name(0)
    return next((peak for key, peak in DATASHEET_BF16.items() if key in name), None)


# --- parts -----------------------------------------------------------------------------------------------------
def part_matmul(args) -> dict:
    import torch
    n = 512 if args.tiny else 8192
    a = torch.randn(n, n, device=args.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=args.device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        _sync(args.device)
        start = time.perf_counter()
        a @ b
        _sync(args.device)
        times.append(time.perf_counter() - start)
    rate = 2 * n ** 3 / statistics.median(times)
    return {"n": n, "tflops": round(rate / 1e12, 1), "datasheet_tflops": (_datasheet_peak(args.device) or 0) / 1e12,
            "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}


def part_zt_llama(args) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    import zerotrain
    from zerotrain import checkpointing as ckpt

    fields, micro, seq, warmup, timed = _size(args, "zt_llama")
    config = _llama_config(fields, seq)
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device(args.device):
        model = LlamaForCausalLM(config)
    ckpt.enable_hf_gradient_checkpointing(model)
    ds = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 0, "bf16": {"enabled": True}, "activation_checkpointing": {},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
          "zero_optimization": {"stage": 3}}
    engine, *_ = zerotrain.initialize(model=model, config=ds)
    setup = time.perf_counter() - start
    times, losses = _timed_steps(args, engine, config, micro, seq, warmup + timed)
    engine.close()
    return {**_throughput(times[warmup:], micro * seq, config, seq, args.device, _datasheet_peak(args.device)),
            "setup_s": round(setup, 1), "losses": losses, "engine": "zerotrain"}


def part_hf_ds_llama(args) -> dict:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    if args.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # (its init_distributed JIT-builds a shared-memory op, cached in ~)
    else:  # no DeepSpeed op should be built on CUDA (torch Adam); if one is, it is this run's, named in the log
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(args.scratch) / "torch_extensions"))
    try:
        import deepspeed
    except Exception as error:  # noqa: BLE001 - the table says why the column is empty
        return {"skipped": f"deepspeed not importable here: {type(error).__name__}: {error}"}
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    fields, micro, seq, warmup, timed = _size(args, "hf_ds_llama")
    config = _llama_config(fields, seq)
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto", "torch_adam": True}},
          "steps_per_print": 10**9}
    start = time.perf_counter()
    training_args = TrainingArguments(
        output_dir=str(Path(args.scratch) / "hf_ds"), deepspeed=ds, per_device_train_batch_size=micro,
        gradient_accumulation_steps=1, max_steps=warmup + timed, learning_rate=1e-4, weight_decay=0.0,
        max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, bf16=True, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=1, save_strategy="no", report_to=[],
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True, use_cpu=args.device == "cpu",
        seed=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # under zero.Init: partitioned at build
    data = [{"input_ids": ids, "labels": ids} for batch in _batches(config.vocab_size, micro, seq, warmup + timed)
            for ids in batch]
    times, losses, marks = [], [], {}

    class Measure(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            _sync(args.device)
            marks["begin"] = time.perf_counter()
            marks.setdefault("setup_s", marks["begin"] - start)

        def on_step_end(self, targs, state, control, **kwargs):
            _sync(args.device)
            times.append(time.perf_counter() - marks["begin"])

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(round(float(logs["loss"]), 4))

    trainer = Trainer(model=model, args=training_args, train_dataset=data, callbacks=[Measure()])
    trainer.train()
    result = {**_throughput(times[warmup:], micro * seq, config, seq, args.device, _datasheet_peak(args.device)),
              "setup_s": round(marks.get("setup_s", 0.0), 1), "losses": losses,
              "engine": f"HF Trainer + DeepSpeed {deepspeed.__version__}"}
    import torch.distributed as dist
    dist.destroy_process_group()
    return result


def _offload_engine(args, part: str, zero: dict, fp8: dict | None = None):
    import torch
    from transformers import LlamaForCausalLM

    import zerotrain

    fields, micro, seq, warmup, timed = _size(args, part)
    config = _llama_config(fields, seq)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config)
    ds = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 0, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
          "zero_optimization": {"stage": 3, **zero}}
    if fp8 is not None:
        ds["fp8"] = fp8
    engine, *_ = zerotrain.initialize(model=model, config=ds)
    return engine, config, micro, seq, warmup, timed


def _timed_steps(args, engine, config, micro: int, seq: int, steps: int) -> tuple[list, list]:
    times, losses = [], []
    for ids in _batches(config.vocab_size, micro, seq, steps):
        ids = ids.to(args.device)
        _sync(args.device)
        begin = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        _sync(args.device)
        times.append(time.perf_counter() - begin)
        losses.append(round(float(loss.detach()), 4))
    return times, losses


def part_offload(args) -> dict:
    import torch

    out = {}
    for name, block in (("plain", {"device": "cpu", "pin_memory": True}),
                        ("super", {"device": "cpu", "pin_memory": True, "super_offload": True})):
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        engine, config, micro, seq, warmup, timed = _offload_engine(args, "offload", {"offload_optimizer": block})
        setup = time.perf_counter() - start
        times, losses = _timed_steps(args, engine, config, micro, seq, warmup + timed)
        out[name] = {"step_s": round(statistics.median(times[warmup:]), 4), "steps_s": [round(t, 4) for t in times],
                     "setup_s": round(setup, 1), "losses": losses, "stats": engine.offload_stats(),
                     "peak_gib": _peak_gib(args.device), "params": _n_params(config)}
        engine.close()
        del engine
    out["ratio_super_over_plain"] = round(out["super"]["step_s"] / out["plain"]["step_s"], 3)
    out["same_losses"] = out["super"]["losses"] == out["plain"]["losses"]
    return out


def part_nvme(args) -> dict:
    import shutil

    from zerotrain.offload.aio import direct_io_supported

    folder = Path(args.scratch) / "nvme_bench"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    nvme = {"device": "nvme", "nvme_path": str(folder), "pin_memory": True}
    start = time.perf_counter()
    engine, config, micro, seq, warmup, timed = _offload_engine(args, "nvme", {"offload_optimizer": nvme,
                                                                               "offload_param": dict(nvme)})
    setup = time.perf_counter() - start
    times, losses = _timed_steps(args, engine, config, micro, seq, warmup + timed)
    report = engine.memory_report()
    result = {"steps_s": [round(t, 3) for t in times], "setup_s": round(setup, 1), "losses": losses,
              "params": _n_params(config), "direct_io": direct_io_supported(str(folder)),
              "offload_param": report.get("offload_param"), "stats": engine.offload_stats(),
              "peak_gib": _peak_gib(args.device),
              "nvme_gib": round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**30, 2)}
    engine.close()
    shutil.rmtree(folder, ignore_errors=True)
    return result


# --- the orchestration -----------------------------------------------------------------------------------------
def part_fp8(args) -> dict:
    import importlib.util

    import torch

    if importlib.util.find_spec("torchao") is None:
        return {"skipped": "torchao is not installed (pip install 'zerotrain[fp8]')"}
    from zerotrain.estimate import estimate
    from transformers import LlamaForCausalLM

    rows = {}
    for name, fp8 in (("bf16", {"enabled": False}), ("fp8", {"enabled": True, "recipe": "tensorwise"})):
        engine, config, micro, seq, warmup, timed = _offload_engine(args, "fp8", {}, fp8=fp8)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, losses = _timed_steps(args, engine, config, micro, seq, warmup + timed)
        rows[name] = {**_throughput(times[warmup:], micro * seq, config, seq, args.device, None), "losses": losses}
        engine.close()
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    predicted = estimate(meta, {"train_micro_batch_size_per_gpu": micro, "bf16": {"enabled": True},
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                "zero_optimization": {"stage": 3}, "fp8": {"enabled": True}},
                         world_size=1, device_type="cuda" if args.device == "cuda" else "cpu", seq_len=seq,
                         micro_batch=micro)
    bf16, fp8 = rows["bf16"], rows["fp8"]
    peak_ratio = round(fp8["peak_gib"] / bf16["peak_gib"], 3) if bf16.get("peak_gib") else None
    return {"bf16": bf16, "fp8": fp8, "tokens_ratio": round(fp8["tokens_per_s"] / bf16["tokens_per_s"], 3),
            "peak_ratio": peak_ratio, "estimate_fp8_transient_gib": round(predicted["fp8"]["transient_bytes"] / 2**30, 3),
            "emulated": predicted["fp8"]["emulated"]}


def run_part(args) -> None:
    """Child: run one part, print its JSON as the last line."""
    result = globals()[f"part_{args.run_part}"](args)
    print("RESULT " + json.dumps(result, default=str), flush=True)


def _row(part: str, record: dict) -> str:
    r = record.get("result") or {}
    if record.get("status") != "ok":
        return f"| {part} | {record.get('status')} | {record.get('seconds', '')} s | {record.get('error', '')[-300:]} |"
    if "skipped" in r:
        return f"| {part} | skipped | | {r['skipped']} |"
    if part == "matmul":
        return f"| matmul | ok | {record['seconds']} s | {r['tflops']} TFLOP/s bf16 measured ({r['device_name']}; " \
               f"datasheet {r['datasheet_tflops']:.0f}) |"
    if part in ("zt_llama", "hf_ds_llama"):
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        return f"| {part} | ok | {record['seconds']} s | {r['engine']}: {r['params'] / 1e9:.2f}B params, " \
               f"{r['tokens_per_s']:.0f} tokens/s, step {r['step_s']} s, {r['model_tflops']} TFLOP/s, MFU {mfu}, " \
               f"peak {r['peak_gib']} GiB, setup {r['setup_s']} s, losses {r['losses']} |"
    if part == "offload":
        return f"| offload | ok | {record['seconds']} s | {r['plain']['params'] / 1e9:.2f}B: plain " \
               f"{r['plain']['step_s']} s, super {r['super']['step_s']} s, super / plain " \
               f"**{r['ratio_super_over_plain']}** (target <= 0.8), same losses {r['same_losses']}, " \
               f"rollbacks {r['super']['stats'].get('rollbacks')} |"
    if part == "nvme":
        return f"| nvme | ok | {record['seconds']} s | {r['params'] / 1e9:.2f}B, steps {r['steps_s']} s, " \
               f"setup {r['setup_s']} s, O_DIRECT {r['direct_io']}, {r['nvme_gib']} GiB on NVMe, " \
               f"peak {r['peak_gib']} GiB |"
    if part == "fp8":
        b, f = r["bf16"], r["fp8"]
        return f"| fp8 | ok | {record['seconds']} s | {f['params'] / 1e9:.2f}B, tensorwise" \
               f"{' (emulated)' if r['emulated'] else ''}: {f['tokens_per_s']:.0f} tokens/s vs bf16 " \
               f"{b['tokens_per_s']:.0f} (**{r['tokens_ratio']}x**), peak {f['peak_gib']} vs {b['peak_gib']} GiB " \
               f"(**{r['peak_ratio'] if r['peak_ratio'] is not None else 'n/a'}x**; estimate's fp8 transient {r['estimate_fp8_transient_gib']} GiB), " \
               f"losses {f['losses']} vs {b['losses']} |"
    return f"| {part} | ok | {record['seconds']} s | {json.dumps(r)[:300]} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / "gpu_bench"))
    parser.add_argument("--scratch", default=str(REPO / "runs" / "gpu_scratch"))
    parser.add_argument("--budget", type=float, default=140.0, help="seconds for every part together")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--nvme-size", choices=sorted(SIZES), default="", help="the nvme part's model (see SIZES)")
    parser.add_argument("--run-part", choices=PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_part:
        run_part(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; known: {', '.join(PARTS)}")
    start, records = time.monotonic(), {}
    for index, part in enumerate(parts):
        left = args.budget - (time.monotonic() - start)
        later = sum(SHARES[p] for p in parts[index + 1:])
        limit = left * SHARES[part] / (SHARES[part] + later)  # its share of what is left (earlier parts' savings too)
        if left < 10:
            records[part] = {"status": "not run", "error": f"budget spent ({left:.0f} s left)"}
        else:
            command = [sys.executable, __file__, "--run-part", part, "--device", args.device, "--scratch",
                       args.scratch] + (["--tiny"] if args.tiny else [])
            command += ["--nvme-size", args.nvme_size] if args.nvme_size else []
            print(f"[gpu_bench] {part}: at most {limit:.0f} s", flush=True)
            began = time.monotonic()
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
                output, code = done.stdout + done.stderr, done.returncode
            except subprocess.TimeoutExpired as expired:
                output = expired.stdout or ""
                output = output.decode(errors="replace") if isinstance(output, bytes) else output
                code = "timeout"
            seconds = round(time.monotonic() - began, 1)
            print(output[-6000:], flush=True)
            lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
            if code == 0 and lines:
                records[part] = {"status": "ok", "seconds": seconds, "result": json.loads(lines[-1][len("RESULT "):])}
            else:
                records[part] = {"status": "timed out" if code == "timeout" else f"failed ({code})",
                                 "seconds": seconds, "error": " ".join(output.strip().splitlines()[-3:])}
        with open(out / "bench.jsonl", "a") as handle:
            handle.write(json.dumps({"part": part, "device": args.device, "tiny": args.tiny, **records[part]},
                                    default=str) + "\n")
        table = ["| part | status | wall | result |", "| --- | --- | --- | --- |"]
        table += [_row(p, records[p]) for p in parts if p in records]
        zt, hf = (records.get(p, {}).get("result") or {} for p in ("zt_llama", "hf_ds_llama"))
        if zt.get("tokens_per_s") and hf.get("tokens_per_s"):
            table.append(f"| zerotrain / HF+DS | ratio | | tokens/s {zt['tokens_per_s'] / hf['tokens_per_s']:.2f}x |")
        (out / "bench.md").write_text("\n".join(table) + "\n")
    print((out / "bench.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
