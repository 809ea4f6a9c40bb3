"""Every option a user can set has a test that sets it: the config schema's keys (walked from the pydantic model),
the flags of `zerotrain train` and `zerotrain train-embedding` (walked from their parsers), and the Hugging Face
arguments the config mapping reads (`config.hf_arguments.ARGUMENT_KEYS`).

`tests/option_coverage.tsv` says, per option, which test function sets it to a non-default value and checks its
effect (`path::function`; a helper that a test spawns counts), or, for the options no test sets yet, `GAP` and why.
This test fails when an option has no row (a new key or flag arrived without its test), when a row names an option
that no longer exists, when a named function is missing or never mentions the option, and when the gaps grow past
today's count: a gap may be closed, never added. What it cannot see is whether the named test checks the option's
effect rather than only passing it: that is what the row's author vouches for (and mutation testing checks).
"""
from __future__ import annotations

import ast
import re
import typing
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel

from zerotrain.cli import build_parser
from zerotrain.config.hf_arguments import ARGUMENT_KEYS
from zerotrain.config.schema import ZeroTrainConfig

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "tests" / "option_coverage.tsv"
COMMANDS = ("train", "train-embedding")
KNOWN_GAPS = 18  # 2026-12-05: the count may only go down


def _config_keys(model: type[BaseModel] = ZeroTrainConfig, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        blocks = [t for t in (field.annotation, *typing.get_args(field.annotation))
                  if isinstance(t, type) and issubclass(t, BaseModel)]
        keys += _config_keys(blocks[0], key + ".") if blocks else [key]
    return keys


def _flags(command: str) -> list[list[str]]:
    """Each option of `command`'s parser, as its long spellings (one row per option, not per spelling)."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    spellings = [[o for o in action.option_strings if o.startswith("--")] for action in commands[command]._actions]
    return [longs for longs in spellings if longs and longs[0] != "--help"]


def options() -> dict[tuple[str, str], list[str]]:
    """(kind, option) -> the strings a test that sets it must contain one of."""
    found: dict[tuple[str, str], list[str]] = {}
    for key in _config_keys():
        found[("config", key)] = [key.rsplit(".", 1)[-1]]
    for command in COMMANDS:
        for longs in _flags(command):
            found[(command, longs[0])] = longs
    for argument in ARGUMENT_KEYS:
        found[("hf", argument)] = [argument, "--" + argument.replace("_", "-")]
    return found


def _rows() -> dict[tuple[str, str], str]:
    rows: dict[tuple[str, str], str] = {}
    for number, line in enumerate(TABLE.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        kind, option, where = line.split("\t")
        assert (kind, option) not in rows, f"{TABLE.name}:{number}: {kind} {option} listed twice"
        rows[(kind, option)] = where
    return rows


@lru_cache(maxsize=None)
def _functions(path: str) -> dict[str, str]:
    """Each function of a test file -> its text: its decorators, the module-level tables they name (a
    `parametrize` over a list of flags), and its body."""
    text = (REPO / path).read_text()
    tree = ast.parse(text)
    tables = {target.id: ast.get_source_segment(text, node) or "" for node in tree.body
              if isinstance(node, (ast.Assign, ast.AnnAssign))
              for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
              if isinstance(target, ast.Name)}
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            named = {n.id for d in node.decorator_list for n in ast.walk(d) if isinstance(n, ast.Name)}
            found[node.name] = "\n".join([*(ast.get_source_segment(text, d) or "" for d in node.decorator_list),
                                          *(tables[name] for name in sorted(named) if name in tables),
                                          ast.get_source_segment(text, node) or ""])
    return found


def test_every_option_has_a_row_and_every_row_an_option():
    current, rows = options(), _rows()
    missing = sorted(f"{kind}\t{option}" for kind, option in current if (kind, option) not in rows)
    stale = sorted(f"{kind}\t{option}" for kind, option in rows if (kind, option) not in current)
    assert not missing, ("options without a row in tests/option_coverage.tsv (add the test that sets each to a "
                         "non-default value and checks its effect):\n" + "\n".join(missing))
    assert not stale, "rows for options that no longer exist:\n" + "\n".join(stale)


def test_each_named_test_exists_and_sets_its_option():
    current = options()
    wrong = []
    for (kind, option), where in _rows().items():
        if where.startswith("GAP"):
            continue
        path, _, function = where.partition("::")
        if not (REPO / path).is_file() or function not in _functions(path):
            wrong.append(f"{kind} {option}: {where} does not exist")
            continue
        source = _functions(path)[function]
        if not any(re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", source) for s in current.get((kind, option), [])):
            wrong.append(f"{kind} {option}: {where} never mentions it")
    assert not wrong, "\n".join(wrong)


def test_gaps_are_explained_and_only_shrink():
    gaps = {option: where for option, where in _rows().items() if where.startswith("GAP")}
    assert all(re.match(r"GAP: \S", where) for where in gaps.values()), "a GAP row says why"
    assert len(gaps) <= KNOWN_GAPS, (f"{len(gaps)} options without a test, {KNOWN_GAPS} before: a new option comes "
                                     f"with its test")
