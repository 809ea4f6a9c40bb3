"""`zerotrain ckpt inspect|verify|import|export`: the checkpoint tools on the command line.

`zerotrain.cli` adds these subcommands with `add_ckpt_parser` and runs them with
`run_ckpt`; the work is done by `tools` (no engine, no process group). Exit status:
0 on success, 1 when the checkpoint is bad (the message names the file or tensor),
2 for usage errors (argparse).
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Optional, TextIO

from .format import CheckpointError
from .tools import export_model, inspect_checkpoint, is_hugging_face_model, verify_checkpoint

_DIR_HELP = ("a checkpoint tag directory (e.g. checkpoints/global_step50), or a save directory "
             "with a `latest` file (its latest checkpoint is used)")


def add_ckpt_parser(sub: argparse._SubParsersAction, prog: str) -> None:
    """Add the `ckpt` command and its `inspect`, `verify` and `export` subcommands to `sub`."""
    ckpt = sub.add_parser(
        "ckpt", help="inspect, verify or export a checkpoint",
        description="Offline tools over a zerotrain checkpoint directory (no processes are started).",
    )
    tools = ckpt.add_subparsers(dest="ckpt_command", metavar="TOOL")
    tools.required = True

    inspect = tools.add_parser(
        "inspect", help="list tensors (dtype, shape, bytes), the step and the topology that wrote it",
        description=("Print what a checkpoint holds: every tensor of the model, master-weight and "
                     "optimizer files with its dtype, shape, bytes and file; the global step and "
                     "samples; the topology that wrote it (world size, ZeRO stage, dtype, batch)."),
    )
    inspect.add_argument("dir", metavar="DIR", help=_DIR_HELP)
    inspect.add_argument("--json", action="store_true", help="print the whole report as JSON")
    inspect.add_argument("--summary", action="store_true",
                         help="print only the totals per kind, not one line per tensor")

    verify = tools.add_parser(
        "verify", help="check every file against the manifest (sizes and crc32 checksums)",
        description=(f"Check a checkpoint against its manifest: every listed file exists with its "
                     f"recorded size and crc32 checksum, and every safetensors header parses. Exit "
                     f"status 0 if intact, 1 otherwise, naming the first bad file "
                     f"(e.g. `{prog} ckpt verify checkpoints && echo intact`)."),
    )
    verify.add_argument("dir", metavar="DIR", help=_DIR_HELP)
    _add_import_parser(tools)

    export = tools.add_parser(
        "export", help="write the model weights in Hugging Face layout, or (--format deepspeed) a DeepSpeed checkpoint",
        description=("Write the model weights (no optimizer or trainer state) to a new directory as "
                     "model-*.safetensors + model.safetensors.index.json (+ config.json and the "
                     "tokenizer files when the model has a Hugging Face config: from_pretrained(OUT) loads it; "
                     "a model that is not a Hugging Face architecture is said so), optionally cast. Weights come from the fp32 "
                     "master copies when the checkpoint has them. The checkpoint is verified first. With --format deepspeed: "
                     "a DeepSpeed 0.19 checkpoint directory to resume from instead (see --format)."),
    )
    export.add_argument("dir", metavar="DIR", help=_DIR_HELP)
    export.add_argument("out", metavar="OUT", help="output directory (must not exist, or be empty)")
    export.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="cast floating-point weights to this dtype (default: as saved)")
    export.add_argument("--merge-lora", nargs="?", const="", default=None, metavar="ADAPTER_DIR",
                        help="fold a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into the "
                             "exported weights: W += B @ A * alpha/r (alpha/sqrt(r) with rslora). Without a value: "
                             "the adapter of a `train --lora-r` checkpoint itself (written into every checkpoint "
                             "directory); the export is then the merged model under the base model's names")
    export.add_argument("--format", choices=("hf", "deepspeed"), default="hf",
                        help="hf (default): the model weights in Hugging Face layout. deepspeed: a whole DeepSpeed 0.19 "
                             "ZeRO checkpoint (OUT/latest, OUT/<tag>/: model states, one optimizer file per rank with "
                             "the fp32 partition and the optimizer states, scheduler, step, client state) that "
                             "DeepSpeed's engine.load_checkpoint(OUT) resumes at --world-size ranks and --stage")
    export.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="with --format deepspeed: the data-parallel world size DeepSpeed will resume at")
    export.add_argument("--stage", type=int, choices=(1, 2, 3), default=None,
                        help="with --format deepspeed: the ZeRO stage DeepSpeed will run (default: the config's, else "
                             "the checkpoint's)")
    export.add_argument("--deepspeed-config", default=None, metavar="JSON",
                        help="with --format deepspeed: the DeepSpeed config the resumed run uses (default: the "
                             "checkpoint's); its zero_optimization (round_robin_gradients, parameter_alignment, "
                             "sub_group_size) and gradient_clipping shape the layout")


def _add_import_parser(tools: argparse._SubParsersAction) -> None:
    imported = tools.add_parser(
        "import", help="convert a DeepSpeed ZeRO checkpoint into a zerotrain checkpoint",
        description=("Read a DeepSpeed 0.19 ZeRO checkpoint (stage 1-3, any world size: a save directory with "
                     "`latest`, or a global_stepN directory) and write it as a zerotrain checkpoint in "
                     "OUT/<tag> with OUT/latest: the fp32 master weights (the consolidation zero_to_fp32.py does), "
                     "every optimizer state, the LR scheduler, the step counters and the client state. "
                     "engine.load_checkpoint(DS_DIR) does this by itself; the command keeps the result."),
    )
    imported.add_argument("dir", metavar="DS_DIR", help="the DeepSpeed checkpoint")
    imported.add_argument("out", metavar="OUT", help="the save directory to write (its <tag> must not exist)")


def run_ckpt(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    """Run one `ckpt` tool; returns the exit status (1 on a bad checkpoint, with one line on stderr)."""
    # sys.stdout is looked up per call, not bound at import: a caller (or pytest) may have replaced it since
    out = sys.stdout if out is None else out
    try:
        if args.ckpt_command == "inspect":
            report = inspect_checkpoint(args.dir)
            if args.json:
                if args.summary:  # totals only: tensor counts per kind instead of one row per tensor
                    report["tensors"] = {kind: len(rows) for kind, rows in report["tensors"].items()}
                json.dump(report, out, indent=2)
                out.write("\n")
            else:
                out.write(format_report(report, per_tensor=not args.summary))
        elif args.ckpt_command == "verify":
            result = verify_checkpoint(args.dir)
            out.write(f"OK {result['path']}: {result['files']} files, {_size(result['bytes'])} "
                      f"match the manifest\n")
        elif args.ckpt_command == "import":
            from .deepspeed_dir import convert_deepspeed
            path = convert_deepspeed(args.dir, args.out)
            out.write(f"imported DeepSpeed checkpoint {args.dir} as {path}\n")
        elif args.ckpt_command == "export" and getattr(args, "format", "hf") == "deepspeed":
            if args.world_size is None or args.dtype is not None or args.merge_lora is not None:
                print("zerotrain ckpt export: --format deepspeed needs --world-size N (the ranks DeepSpeed resumes "
                      "at) and takes neither --dtype nor --merge-lora", file=sys.stderr, flush=True)
                return 2
            from .deepspeed_export import ExportWarning, export_deepspeed
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ExportWarning)
                path = export_deepspeed(args.dir, args.out, args.world_size, stage=args.stage,
                                        config=args.deepspeed_config)
            for said in caught:  # what the export changed or left out: one line each (others as Python shows them)
                if issubclass(said.category, ExportWarning):
                    print(f"zerotrain ckpt export: warning: {said.message}", file=sys.stderr, flush=True)
                else:
                    warnings.showwarning(said.message, said.category, said.filename, said.lineno)
            out.write(f"exported {args.dir} as a DeepSpeed checkpoint for {args.world_size} ranks: {path}\n")
        elif args.ckpt_command == "export":
            path = export_model(args.dir, args.out, dtype=args.dtype, merge_lora=getattr(args, "merge_lora", None))
            merged = getattr(args, "merge_lora", None)
            lora = "" if merged is None else f", LoRA {merged or 'of the checkpoint'} folded in"
            out.write(f"exported model weights ({args.dtype or 'as saved'}{lora}) to {path}\n")
            if not is_hugging_face_model(path):
                print(f"zerotrain ckpt export: note: {args.dir} is not a Hugging Face architecture (no config.json): "
                      f"the export holds the weights under the model's own names, which transformers' "
                      f"from_pretrained cannot load", file=sys.stderr, flush=True)
        else:  # pragma: no cover - argparse rejects other names
            raise ValueError(args.ckpt_command)
    except CheckpointError as error:
        print(f"zerotrain ckpt {args.ckpt_command}: {error}", file=sys.stderr, flush=True)
        return 1
    out.flush()
    return 0



def format_report(report: dict, per_tensor: bool = True) -> str:
    """The `inspect` report as text: a header, then one line per tensor and a total per kind."""
    lines = [f"checkpoint  {report['path']}  ({report['kind']})"]
    if report.get("global_steps") is not None:
        lines.append(f"step        {report['global_steps']}  (samples consumed: {report.get('global_samples')})")
    topology = report.get("topology")
    if topology:
        lines.append("written by  " + ", ".join(f"{k}={v}" for k, v in topology.items()))
    if report.get("zerotrain_version"):
        lines.append(f"zerotrain   {report['zerotrain_version']}")
    if "files" in report:
        lines.append(f"files       {report['files']} ({_size(report['total_file_bytes'])})")
    for kind, rows in report["tensors"].items():
        lines.append("")
        lines.append(f"{kind}: {len(rows)} tensors, {_size(report['bytes'][kind])}")
        if not per_tensor or not rows:
            continue
        width = max(len(row["name"]) for row in rows)
        for row in rows:
            shape = "x".join(str(d) for d in row["shape"]) or "scalar"
            lines.append(f"  {row['name']:<{width}}  {row['dtype']:<8}  {shape:<14}  {row['bytes']:>12,}  "
                         f"{row['file']}")
    return "\n".join(lines) + "\n"


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:,} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)
