"""`zerotrain port PATH... [--write] [--table]`: show (or apply) the rewrite of a DeepSpeed program.

Each PATH is a file or a directory (its `*.py` and `*.sh` files, recursively). The unified diff of every
changed file goes to stdout; `--write` writes the files instead. What could not be ported is listed on
stderr, one line each (`file:line: what -- advice`), and makes the exit status 1. `--table` prints
docs/porting.md's table of DeepSpeed import paths.
"""
from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from .paths import porting_table
from .rewrite import Unported, rewrite_python, rewrite_shell

__all__ = ["add_port_parser", "run_port", "port_files"]

_SUFFIXES = {".py": rewrite_python, ".sh": rewrite_shell, ".bash": rewrite_shell}


def add_port_parser(sub) -> None:
    port = sub.add_parser(
        "port", help="rewrite a DeepSpeed program's imports and launcher lines to zerotrain (shows a diff)",
        description=("Rewrite `import deepspeed`, `import deepspeed.comm as dist`, `from deepspeed.X import Y`, "
                     "transformers' HfDeepSpeedConfig / is_deepspeed_zero3_enabled imports and the `deepspeed` "
                     "launcher line of shell scripts to zerotrain; print a unified diff (--write applies it). "
                     "Anything without a zerotrain counterpart is listed with what to write instead "
                     "(docs/porting.md)."))
    port.add_argument("paths", nargs="*", metavar="PATH", help="files or directories (*.py, *.sh)")
    port.add_argument("--write", action="store_true", help="write the rewritten files instead of printing a diff")
    port.add_argument("--table", action="store_true", help="print docs/porting.md's table of import paths")


def _files(paths: list[str]) -> list[Path]:
    found = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"zerotrain port: {name}: no such file or directory")
    return found


def port_files(paths: list[str]) -> list[tuple[Path, str, str, list[Unported]]]:
    """(file, old text, new text, what was not ported) for every file under `paths`."""
    out = []
    for path in _files(paths):
        rewrite = _SUFFIXES.get(path.suffix, rewrite_shell if path.suffix == "" else rewrite_python)
        old = path.read_text(encoding="utf-8")
        new, unported = rewrite(old)
        out.append((path, old, new, unported))
    return out


def run_port(args: argparse.Namespace) -> int:
    """Print the diff (or write the files) and list what was not ported; 1 when something was not."""
    if args.table:
        sys.stdout.write(porting_table())
        return 0
    if not args.paths:
        raise ValueError("zerotrain port: give one or more files or directories (or --table)")
    left = 0
    for path, old, new, unported in port_files(args.paths):
        if new != old:
            if args.write:
                path.write_text(new, encoding="utf-8")
                print(f"ported {path}")
            else:
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                                           *(f"{side}/{path}" if not path.is_absolute() else str(path) for side in "ab")))
        for item in unported:
            print(f"{path}:{item.line}: {item.kind}: {item.what} -- {item.advice}", file=sys.stderr)
            left += 1
    return 1 if left else 0
