"""`zerotrain generate`'s run, and ZeRO-Inference's engine: a Hugging Face causal LM directory as a forward-only
engine on the run layer's one path, the one `zerotrain train` takes.

The config is built once (`forward_only_config`: a training config's optimizer and scheduler dropped, a micro-batch
of 1 when it gives no batch) and parsed once (`RunConfig`, its batch resolved for the job's ranks); the model is
`run.model.train_model`'s (at ZeRO-3 inside ``zero.Init`` with that config, so the whole model never exists on one
rank), the engine `run.model.train_engine`'s (``zerotrain.initialize`` handed the parsed config: without an optimizer
a forward-only engine, `zero.forward_only`), the directory's weights `run.model.load_weights`' (each rank reading its
own shard ranges; with ``offload_param`` the shards live off the device and are read ahead while the model runs).
At world > 1 ``engine.module.generate(...)`` keeps every rank stepping until all have finished (``synced_gpus``).
`run_generate` is one rank of the command, ending as every run does (close, then a barrier before teardown).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Union

from zerotrain.command import CLIError

__all__ = ["forward_only_config", "load_for_inference", "run_generate"]

# Blocks of a training config that a forward-only engine has no use for (a training config can be reused).
TRAINING_BLOCKS = ("optimizer", "scheduler")


def forward_only_config(config: Union[dict, str, os.PathLike]) -> dict:
    """The config (a dict, or a JSON file) as a dict without its optimizer and scheduler blocks; without a batch size
    a micro-batch of 1 (the batch triple means nothing to generation, but a config has one, as DeepSpeed's)."""
    if isinstance(config, dict):
        raw = dict(config)
    else:
        from zerotrain.config import ConfigError
        try:
            with open(config, encoding="utf-8") as handle:
                raw = json.load(handle)
        except (OSError, json.JSONDecodeError) as error:
            raise ConfigError(f"cannot read config {config}: {error}", file=str(config)) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config {config}: a JSON object is expected", file=str(config))
    for block in TRAINING_BLOCKS:
        raw.pop(block, None)
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for key in batch_keys:
        if raw.get(key) == "auto":
            raw.pop(key)
    if raw.get(batch_keys[0]) is None and raw.get(batch_keys[1]) is None:
        raw[batch_keys[1]] = 1
    return raw


def load_for_inference(model_dir: Union[str, os.PathLike], config: Union[dict, str, os.PathLike],
                       seed: int = 0) -> tuple[Any, Any]:
    """`(engine, tokenizer)`: the model directory as a forward-only engine with its weights loaded, on the run
    layer's path (the config built and parsed once, `train_model`, `train_engine`, `load_weights`).

    `config` is a DeepSpeed-style config (dict or JSON path); its `optimizer` and `scheduler` blocks, if any, are
    ignored, and without a batch size a micro-batch of 1 is assumed. Collective: every rank calls it. The model's KV
    cache is switched on (training builds switch it off). A ValueError when the directory has no weights."""
    from zerotrain import dist
    from zerotrain.models.hf import load_tokenizer, resolve_model
    from zerotrain.run.config import RunConfig
    from zerotrain.run.model import load_weights, train_engine, train_model

    source = resolve_model(str(model_dir))
    if source.weights_dir is None:
        raise ValueError(f"{model_dir}: no weights to generate with")
    run_config = RunConfig(forward_only_config(config), world_size=int(os.environ.get("WORLD_SIZE", "1")), steps=0)
    dist.init_distributed(timeout=run_config.parsed.comm_timeout_seconds)
    model = train_model(source, run_config, seed=seed)
    engine = train_engine(model, run_config)  # no optimizer block: forward-only
    engine.eval()
    load_weights(engine, source, model)  # the weights alone, each rank its own shards
    model.config.use_cache = True
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = True
    return engine, load_tokenizer(source)


def run_generate(args: argparse.Namespace) -> int:
    """One rank of `zerotrain generate`: every rank generates for its share of `args.prompt` (the same number of
    generate calls on every rank, a rank without a prompt of its own repeats the first one and discards it); rank 0
    prints them in order. The exit status."""
    import torch

    from zerotrain import dist
    from zerotrain.comm import Comm
    from zerotrain.models.hf import ModelError

    try:
        try:
            engine, tokenizer = load_for_inference(args.model, args.config)
        except ModelError as exc:  # it names the directory or file
            raise CLIError(str(exc)) from None
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
        gathered = [mine] if world == 1 else Comm(None, rank, world).all_gather_object(mine)
        if rank == 0:
            texts = {index: text for part in gathered for index, text in part.items()}
            for index, prompt in enumerate(prompts):
                print(f"### prompt {index}: {prompt}\n{prompt}{texts[index]}", flush=True)
        engine.close()  # as every run ends (`zerotrain.run.finish_run`): pending work released, then a barrier
        dist.barrier()  # no rank tears its groups down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    return 0
