"""`zerotrain merge`: the merge on the command line.

Either flags (`--method M --models A B --weights 0.5 0.5 [--base DIR] [--param NAME=VALUE]
--out OUT`) or a mergekit-style YAML file (`zerotrain merge CONFIG.yml OUT`); flags given
with a YAML file override its settings. Exit status 0 on success, 1 when the inputs
cannot be merged (one line on stderr naming the tensor, file or setting), 2 for usage errors.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from ..lora import LoraError
from .errors import MergeError
from .recipe import METHODS, ModelSpec, Recipe, parse_size, parse_value, recipe_from_yaml


def add_merge_parser(sub: argparse._SubParsersAction) -> None:
    """Add the `merge` subcommand to `sub`."""
    parser = sub.add_parser(
        "merge", help="merge models (linear, task arithmetic, TIES, DARE, SLERP, LoRA folding), streamed",
        description=("Merge unified zerotrain checkpoints or Hugging Face model directories tensor by tensor "
                     "into a new Hugging Face model directory (sharded safetensors + index + config + "
                     "tokenizer + merge_config.json). Give the settings as flags, or as a mergekit-style "
                     "YAML file: `zerotrain merge CONFIG.yml OUT`. A model may be given as DIR+ADAPTER_DIR "
                     "to fold a PEFT LoRA adapter into it first."),
    )
    parser.add_argument("config", nargs="?", metavar="CONFIG.yml", help="mergekit-style YAML merge config")
    parser.add_argument("out_dir", nargs="?", metavar="OUT", help="output directory (with CONFIG.yml)")
    parser.add_argument("--method", choices=sorted(METHODS), help="merge method")
    parser.add_argument("--models", nargs="+", metavar="DIR", help="input models (DIR or DIR+LORA_ADAPTER_DIR)")
    parser.add_argument("--weights", nargs="+", type=float, metavar="W", help="one weight per model")
    parser.add_argument("--densities", nargs="+", type=float, metavar="D",
                        help="one density per model (ties, dare_*)")
    parser.add_argument("--base", metavar="DIR", help="base model (task_arithmetic, ties, dare_*, slerp's t=0)")
    parser.add_argument("--include", metavar="REGEX", help="keep only tensors whose name matches (re.search)")
    parser.add_argument("--exclude", metavar="REGEX", help="drop tensors whose name matches (re.search)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="method parameter, e.g. t=0.5, t=0,0.5,1 (over the layers), lambda=0.8, "
                             "normalize=false, consensus=count, seed=1, adapter=DIR (lora); repeatable")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="output dtype (default: the source's)")
    parser.add_argument("--tokenizer-source", metavar="base|DIR",
                        help="when vocabulary sizes differ: the model whose vocabulary (and tokenizer) the "
                             "output takes; other models' embedding rows are cut or filled from it")
    parser.add_argument("--shard-size", default=None, metavar="SIZE", help="max bytes per output file (default 5GB)")
    parser.add_argument("--max-memory", default=None, metavar="SIZE",
                        help="refuse to start if merging one tensor would need more than this (e.g. 2GiB)")
    parser.add_argument("--out", metavar="OUT", help="output directory (must not exist, or be empty)")


def recipe_from_args(args: argparse.Namespace) -> tuple[Recipe, str]:
    """The Recipe and output directory the parsed arguments describe (MergeError on bad usage)."""
    params = {}
    for item in args.param:
        if "=" not in item:
            raise MergeError(f"--param {item!r}: expected NAME=VALUE")
        key, value = item.split("=", 1)
        params[key.strip()] = parse_value(value)
    out = args.out or args.out_dir
    if args.config is not None and args.out_dir is None and args.out is None:
        raise MergeError("no output directory: zerotrain merge CONFIG.yml OUT (or --out OUT)")
    if out is None:
        raise MergeError("no output directory (--out OUT)")
    shard = parse_size(args.shard_size)
    max_memory = parse_size(args.max_memory)
    if args.config is not None:
        recipe = recipe_from_yaml(args.config, method=args.method, base=args.base, include=args.include,
                                  exclude=args.exclude, dtype=args.dtype, tokenizer_source=args.tokenizer_source,
                                  shard_size=shard, max_memory=max_memory)
        recipe.params.update(params)
        return recipe, out
    if not args.method or not args.models:
        raise MergeError("give --method and --models (or a CONFIG.yml)")
    models = [ModelSpec(path) for path in args.models]
    for flag, values, key in (("--weights", args.weights, "weight"), ("--densities", args.densities, "density")):
        if values is not None:
            if len(values) != len(models):
                raise MergeError(f"{flag} has {len(values)} values for {len(models)} models")
            for model, value in zip(models, values):
                model.params[key] = value
    if args.method == "lora" and "adapter" in params:
        models[0].params["adapter"] = params.pop("adapter")
    settings = dict(method=args.method, models=models, base=args.base, params=params, include=args.include,
                    exclude=args.exclude, dtype=args.dtype, tokenizer_source=args.tokenizer_source,
                    max_memory=max_memory)
    if shard is not None:
        settings["shard_size"] = shard
    return Recipe(**settings), out


def run_merge(args: argparse.Namespace) -> int:
    """Run `zerotrain merge`; returns the exit status."""
    from .run import merge

    try:
        recipe, out = recipe_from_args(args)
        merge(recipe, out, log=lambda line: print(line, flush=True))
    except (MergeError, LoraError) as error:
        print(f"zerotrain merge: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="zerotrain")
    add_merge_parser(parser.add_subparsers(dest="command"))
    return run_merge(parser.parse_args(["merge", *(argv or [])]))
