"""`zerotrain generate`: greedy continuations of prompts by a Hugging Face causal LM directory, ZeRO-sharded
(ZeRO-Inference). The command is argument parsing and a call into the run layer (`zerotrain.run.generate`: the config
built and parsed once, the model, engine and weights on `zerotrain train`'s path), where `load_for_inference(model_dir,
config)` lives (re-exported here, its documented name): a forward-only engine (``zerotrain.initialize`` without an
optimizer: no gradients, masters or optimizer states, ``zerotrain.zero.forward_only``), at ZeRO-3 built inside
``zero.Init``, with ``offload_param`` (``cpu`` or ``nvme``) its shards read ahead while the model runs.

`zerotrain generate --model DIR --config CFG --prompt TEXT [--prompt TEXT ...] [--max-new-tokens N]
[--nproc N]` prints greedy continuations; with several ranks the prompts are spread over them.
"""
from __future__ import annotations

import argparse

from zerotrain.run.generate import load_for_inference

__all__ = ["load_for_inference", "add_generate_parser", "run_generate", "worker_argv"]


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
    """One rank of `zerotrain generate` (`zerotrain.run.generate.run_generate`: the run layer's config, model and
    weights path, the one `zerotrain train` takes); the exit status."""
    from zerotrain.command import CLIError
    from zerotrain.run.generate import run_generate as generate

    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return generate(args)
