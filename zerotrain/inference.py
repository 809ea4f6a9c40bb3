"""ZeRO-Inference: a Hugging Face causal LM directory as a forward-only engine, and `zerotrain generate`.

`load_for_inference(model_dir, config)` builds the model from its directory (``zerotrain.models.hf``;
at ZeRO-3 inside ``zero.Init``, so the whole model never exists on one rank), makes a forward-only engine
of it (``zerotrain.initialize`` without an optimizer: no gradients, masters or optimizer states; see
``zerotrain.zero.forward_only``) and loads the directory's safetensors, each rank reading only its own
shard ranges. With ``offload_param`` (``cpu`` or ``nvme``) the shards live off the device and are read
ahead along the recorded order of gathers while the model runs, so a model whose weights do not fit in
device (or, with ``nvme`` and a small ``max_in_cpu``, host) memory still generates. At world > 1
``engine.module.generate(...)`` keeps every rank stepping until all have finished (``synced_gpus``).

`zerotrain generate --model DIR --config CFG --prompt TEXT [--prompt TEXT ...] [--max-new-tokens N]
[--nproc N]` prints greedy continuations; with several ranks the prompts are spread over them.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional, Union

import torch

__all__ = ["load_for_inference", "add_generate_parser", "run_generate", "worker_argv"]

# Blocks of a training config that a forward-only engine has no use for (a training config can be reused).
_TRAINING_BLOCKS = ("optimizer", "scheduler")


def _forward_only_config(config: Union[dict, str, os.PathLike]) -> dict:
    """The config as a dict without its optimizer and scheduler blocks."""
    if isinstance(config, dict):
        raw = dict(config)
    else:
        from .config import ConfigError
        try:
            with open(config, encoding="utf-8") as handle:
                raw = json.load(handle)
        except (OSError, json.JSONDecodeError) as error:
            raise ConfigError(f"cannot read config {config}: {error}", file=str(config)) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config {config}: a JSON object is expected", file=str(config))
    for block in _TRAINING_BLOCKS:
        raw.pop(block, None)
    # The batch triple means nothing to generation, but the config needs one (as DeepSpeed's does): one sample.
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for key in batch_keys:
        if raw.get(key) == "auto":
            raw.pop(key)
    if raw.get(batch_keys[0]) is None and raw.get(batch_keys[1]) is None:
        raw[batch_keys[1]] = 1
    return raw


def load_for_inference(model_dir: Union[str, os.PathLike], config: Union[dict, str, os.PathLike],
                       seed: int = 0) -> tuple[Any, Any]:
    """`(engine, tokenizer)`: the model directory as a forward-only engine with its weights loaded.

    `config` is a DeepSpeed-style config (dict or JSON path); its `optimizer` and `scheduler` blocks, if
    any, are ignored, and without a batch size a micro-batch of 1 is assumed. Collective: every rank calls it. The model's KV cache is switched on (training
    builds switch it off).
    """
    from .config import load_config
    from .initialize import initialize
    from .models.hf import build_model, load_tokenizer, resolve_model
    from .precision import training_dtype
    from .zero import Init

    source = resolve_model(str(model_dir))
    if source.weights_dir is None:
        raise ValueError(f"{model_dir}: no weights to generate with")
    raw = _forward_only_config(config)
    run_config = load_config(raw)
    dtype = training_dtype(run_config.precision)
    stage3 = run_config.zero_optimization.stage == 3
    init = Init(dtype=dtype, timeout_seconds=run_config.comm_timeout_seconds) if stage3 else None
    model = build_model(source, dtype, init=init, seed=seed)
    engine = initialize(model=model, config=raw)[0]
    engine.eval()
    engine.load_checkpoint(source.weights_dir)  # forward-only: the weights alone, each rank its own shards
    model.config.use_cache = True
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = True
    return engine, load_tokenizer(source)


# --- the command ---------------------------------------------------------------------------------
def add_generate_parser(sub) -> argparse.ArgumentParser:
    """The `generate` subcommand's parser (the CLI adds torchrun's node options to it)."""
    generate = sub.add_parser(
        "generate",
        help="generate text with a Hugging Face model directory, ZeRO-sharded (ZeRO-Inference)",
        description=("Load a local Hugging Face causal-LM directory as a forward-only engine with the given "
                     "DeepSpeed-style config (at ZeRO-3 partitioned over the ranks, with offload_param cpu/nvme "
                     "kept off the device; optimizer and scheduler blocks are ignored) and print the greedy "
                     "continuation of each --prompt. With --nproc N the prompts are spread over the ranks."),
    )
    generate.add_argument("--model", required=True, metavar="DIR", help="a local Hugging Face model directory")
    generate.add_argument("--config", required=True, metavar="CFG", help="a DeepSpeed-style JSON config")
    generate.add_argument("--prompt", required=True, action="append", metavar="TEXT",
                          help="a prompt (repeat for several)")
    generate.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate per prompt")
    generate.add_argument("--nproc", type=int, default=1, metavar="N", help="processes (ranks) on this machine")
    return generate


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The command each worker of `--nproc N` runs."""
    argv = ["generate", f"--model={args.model}", f"--config={args.config}",
            f"--max-new-tokens={args.max_new_tokens}"]
    for prompt in args.prompt:
        argv.append(f"--prompt={prompt}")
    return argv


def run_generate(args: argparse.Namespace) -> int:
    """Every rank generates for its share of the prompts (the same number of generate calls on every rank, a
    rank without a prompt of its own repeats the first one and discards it); rank 0 prints them in order."""
    from . import dist

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    engine, tokenizer = load_for_inference(args.model, args.config)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine: dict[int, str] = {}
        prompts = list(args.prompt)
        rounds = -(-len(prompts) // world)
        for round_index in range(rounds):
            index = round_index * world + rank
            prompt = prompts[index] if index < len(prompts) else prompts[0]
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(engine.device)
            out = engine.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            if index < len(prompts):
                mine[index] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        gathered = _gather_objects(mine, world)
        if rank == 0:
            texts = {index: text for part in gathered for index, text in part.items()}
            for index, prompt in enumerate(prompts):
                print(f"### prompt {index}: {prompt}\n{prompt}{texts[index]}", flush=True)
        engine.close()
        # the last collective before teardown is a barrier (torch's on gloo: its work holds no tensor), not the
        # all-gather above, whose work gloo's thread may release while the interpreter finalizes (SIGABRT)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _gather_objects(obj: Any, world: int) -> list:
    if world == 1:
        return [obj]
    from .comm import Comm

    return Comm(None, torch.distributed.get_rank(), world).all_gather_object(obj)
