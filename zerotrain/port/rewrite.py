"""Rewriting a DeepSpeed program's imports and launcher lines to zerotrain, as source text.

Python files: every `import deepspeed...` / `from deepspeed... import ...` statement (and transformers'
`HfDeepSpeedConfig` / `is_deepspeed_zero3_enabled` imports) is replaced by the zerotrain import the table
in `zerotrain.port.paths` gives, binding the same local names, so the rest of the program is untouched.
Statements are found with the standard library's `tokenize` (not libcst, and not `ast` over the whole
file): it needs no extra dependency, it keeps every byte outside the rewritten statements (comments,
formatting; a comment inside a rewritten statement of several lines follows the new one), and it still finds the statements of a file that does not parse as a whole; each statement
found is then read with `ast`. A statement naming anything without a zerotrain counterpart is left as
it is and reported with the guide's advice (`Unported`).

Shell scripts: a `deepspeed [launcher options] script.py args` command becomes `zerotrain launch
[options] script.py args` (`--num_gpus N` / `--include localhost:0,1` -> `--nproc N`, `--num_nodes` ->
`--nnodes`, `--master_addr` / `--master_port` / `--node_rank` -> `--master-addr` / `--master-port` /
`--node-rank`, `--no_local_rank` -> `--no-local-rank`; CPU core binding `--bind_cores_to_rank` /
`--bind_core_list` is dropped); a command that names its hosts (`--hostfile`, or `--include` over several hosts)
keeps every option as written, since `zerotrain launch` takes DeepSpeed's multi-host options with their meaning
(`zerotrain.hostfile`); a command with another launcher option is left as it is and reported.
"""
from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Optional

from .paths import MODULES, NOT_PROVIDED, TRANSFORMERS, advice_for, is_package, lookup, not_provided

__all__ = ["Unported", "rewrite_python", "rewrite_shell"]


@dataclass(frozen=True)
class Unported:
    """Something left as it was (or, `kind` "check", rewritten on a guess to be checked): where (1-based
    line), what, and what to write instead."""

    line: int
    what: str
    advice: str
    kind: str = "not ported"


# --- Python ----------------------------------------------------------------------------------------
def _statements(source: str) -> list[tuple[tuple[int, int], tuple[int, int], bool, list[str]]]:
    """(start, end, starts_line, comments) of every import statement: (row, col) positions from tokenize, the
    end before a trailing comment; `starts_line`: nothing but indentation precedes it on its line; `comments`:
    those inside a statement of several lines (kept after the rewritten one)."""
    found = []
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    at_start, first_on_line = True, True
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if token.type in (tokenize.NEWLINE, tokenize.NL):
            at_start = first_on_line = True
        elif token.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT, tokenize.ENCODING):
            pass
        elif token.type == tokenize.OP and token.string == ";":
            at_start, first_on_line = True, False
        elif token.type == tokenize.OP and token.string == ":" and _opens_body(tokens, index):
            at_start, first_on_line = True, False  # `if x: import deepspeed`
        elif at_start and token.type == tokenize.NAME and token.string in ("import", "from"):
            end, depth, last = index, 0, token
            while end < len(tokens):
                current = tokens[end]
                if current.type == tokenize.OP and current.string in "([{":
                    depth += 1
                elif current.type == tokenize.OP and current.string in ")]}":
                    depth -= 1
                elif depth == 0 and (current.type in (tokenize.NEWLINE, tokenize.ENDMARKER)
                                     or (current.type == tokenize.OP and current.string == ";")):
                    break
                if current.type not in (tokenize.COMMENT, tokenize.NL):
                    last = current
                end += 1
            comments = [t.string for t in tokens[index:end] if t.type == tokenize.COMMENT and t.start[0] < last.end[0]]
            found.append((token.start, last.end, first_on_line, comments))
            index = end
            at_start = False
            continue
        else:
            at_start = False
        index += 1
    return found


def _opens_body(tokens: list, index: int) -> bool:
    """True when the `:` at `index` ends a compound statement's header on its line (a body may follow)."""
    line_start = index  # the logical line's start: a header over several lines (inside brackets) is one line
    while line_start > 0 and tokens[line_start - 1].type not in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
        line_start -= 1
    while tokens[line_start].type in (tokenize.NL, tokenize.COMMENT):  # blank and comment lines before it
        line_start += 1
    head = tokens[line_start].string
    return head in ("if", "elif", "else", "try", "except", "finally", "with", "for", "while", "def", "class", "async",
                    "match", "case")


def _offsets(source: str) -> list[int]:
    starts, total = [0], 0
    for line in source.splitlines(keepends=True):
        total += len(line)
        starts.append(total)
    return starts


def _alias(name: str, asname: Optional[str]) -> str:
    return f"{name} as {asname}" if asname and asname != name else name


def _from(module: str, names: list[tuple[str, Optional[str]]]) -> str:
    return f"from {module} import " + ", ".join(_alias(name, asname) for name, asname in names)


def _port_import(node: ast.Import, line: int, unported: list[Unported]) -> Optional[list[str]]:
    """The statements replacing `import ...` (None: nothing to change, or something unmappable)."""
    parts, extra, changed = [], [], False
    for alias in node.names:
        name = alias.name
        if name != "deepspeed" and not name.startswith("deepspeed."):
            parts.append(_alias(name, alias.asname))
            continue
        entry = lookup(name)
        if entry is None:
            unported.append(Unported(line, f"import {name}", advice_for(name)))
            return None
        changed = True
        if alias.asname:
            parts.append(f"{entry.target} as {alias.asname}")
        elif name == "deepspeed":
            parts.append("zerotrain as deepspeed")
        elif entry.mirrored:  # `deepspeed.X.y` in the code: bind `deepspeed` to zerotrain, load zerotrain.X
            parts.append("zerotrain as deepspeed")
            extra.append(f"import {entry.target}")
        else:
            unported.append(Unported(line, f"import {name}",
                                     f"write `import {entry.target} as <name>` and use that name "
                                     f"({name} is {entry.target} in zerotrain)"))
            return None
    if not changed:
        return None
    return ["import " + ", ".join(parts)] + extra


def _port_from(node: ast.ImportFrom, line: int, unported: list[Unported]) -> Optional[list[str]]:
    """The statements replacing `from ... import ...` (None: nothing to change, or something unmappable)."""
    module = node.module or ""
    if node.level:
        return None
    if module in TRANSFORMERS:
        mapping = TRANSFORMERS[module]
        moved = [(alias, mapping[alias.name]) for alias in node.names if alias.name in mapping]
        if not moved:
            return None
        kept = [(alias.name, alias.asname) for alias in node.names if alias.name not in mapping]
        return _grouped([((target_module, target), alias.asname or alias.name) for alias, (target_module, target)
                         in moved]) + ([_from(module, kept)] if kept else [])
    if module != "deepspeed" and not module.startswith("deepspeed."):
        return None
    entry = lookup(module)
    if entry is None:
        # a package above listed paths: `from deepspeed.runtime.activation_checkpointing import checkpointing`
        found = [(_submodule(module, alias.name), alias) for alias in node.names] \
            if is_package(module) and not not_provided(module) else []
        if found and all(where is not None for where, _ in found):
            return _grouped([(where, alias.asname or alias.name) for where, alias in found])
        unported.append(Unported(line, f"from {module} import ...", advice_for(module)))
        return None
    targets, missing = [], []
    for alias in node.names:
        if alias.name == "*":
            if not entry.mirrored:
                missing.append("*")
            targets.append(((entry.target, "*"), None))
            continue
        where = entry.where(alias.name) or _submodule(module, alias.name)
        if where is None:
            missing.append(alias.name)
        else:
            targets.append((where, alias.asname or alias.name))
    if missing:
        for name in missing:
            unported.append(Unported(line, f"from {module} import {name}", advice_for(module, name)))
        return None
    return _grouped(targets)


def _submodule(module: str, name: str) -> Optional[tuple[str, str]]:
    """(zerotrain module, name) for `from <module> import <name>` when `name` is a DeepSpeed submodule that
    zerotrain mirrors (`from deepspeed import runtime`, `from deepspeed.runtime import utils`), else None."""
    full = f"{module}.{name}"
    if not_provided(full):
        return None
    sub, parent = lookup(full), _target(module)
    mirrored = f"{parent}.{name}"
    if sub is not None:
        where, _, leaf = sub.target.rpartition(".")
        return (parent, name) if sub.target == mirrored else (where, leaf)
    if is_package(full) and any(entry.mirrored and entry.target.startswith(mirrored + ".") for entry in MODULES):
        return parent, name
    return None


def _grouped(targets: list[tuple[tuple[str, str], Optional[str]]]) -> list[str]:
    """`from M import a as x, b` statements, one per module, in first-seen order; local names kept."""
    by_module: dict[str, list[tuple[str, Optional[str]]]] = {}
    for (module, name), local in targets:
        by_module.setdefault(module, []).append((name, local))
    return [_from(module, names) for module, names in by_module.items()]


# --- attribute chains: `deepspeed.runtime.utils.set_random_seed(...)`, `ds.moe.layer.MoE(...)` -----------------
def _bindings(tree: ast.AST) -> dict[str, str]:
    """Local name -> the DeepSpeed module it is bound to by the file's imports (anywhere in the file): `import
    deepspeed[.x]` binds `deepspeed`, `import deepspeed.x as n` and `from deepspeed import x as n` (x a module)
    bind `n`."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "deepspeed" or alias.name.startswith("deepspeed."):
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["deepspeed"] = "deepspeed"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                (node.module == "deepspeed" or node.module.startswith("deepspeed.")):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if lookup(full) is not None or is_package(full) or not_provided(full):
                    bound[alias.asname or alias.name] = full
    return bound


def _chains(tree: ast.AST, bound: dict[str, str]) -> list[tuple[ast.Name, list[ast.Attribute]]]:
    """Every longest `name.a.b...` chain on a bound name: the name and its Attribute nodes, innermost first."""
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        attrs, value = [], node
        while isinstance(value, ast.Attribute):
            attrs.append(value)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bound:
            found.append((value, attrs[::-1]))
    return found


def _target(module: str) -> str:
    """zerotrain's module for DeepSpeed's `module` (a listed path, or a package: its mirrored name)."""
    entry = lookup(module)
    return entry.target if entry is not None else "zerotrain" + module[len("deepspeed"):]


def _port_chain(root: ast.Name, attrs: list[ast.Attribute], module: str, unported: list[Unported]
                ) -> Optional[tuple[tuple[int, int], tuple[int, int], str]]:
    """Resolve `root.a.b...` (root bound to DeepSpeed's `module`) against the path table, up to the first name
    inside a module (what follows is that object's own attributes): None when zerotrain has it under the same
    attributes; a replacement (start, end, text) of the attributes after `root` when zerotrain has it elsewhere
    under the root's module (`deepspeed.comm.get_rank` -> `deepspeed.dist.get_rank`, `deepspeed.runtime.engine.
    DeepSpeedEngine` -> `deepspeed.engine.ZeroTrainEngine`); otherwise it is listed in `unported` (with what to
    write instead) and None is returned. A module that moved is followed to its end: the name taken from it is
    checked against the module's entry too (`deepspeed.comm.get_world_group` is listed, not rewritten)."""
    root_target = _target(module)
    here, current, last = module, root_target, -1  # DeepSpeed's path, zerotrain's, attrs[:last + 1] resolved
    for index, node in enumerate(attrs):
        attr, full = node.attr, f"{here}.{node.attr}"
        written = ast.unparse(attrs[index + 1] if index + 1 < len(attrs) else node)  # with the name used from it
        if not_provided(here, attr):
            unported.append(Unported(node.lineno, written, advice_for(full) if full in NOT_PROVIDED
                                     else advice_for(here, attr)))
            return None
        entry = lookup(full)
        if entry is not None:
            here, current, last = full, entry.target, index
            continue
        if is_package(full):
            here, current, last = full, f"{current}.{attr}", index
            continue
        owner = lookup(here)
        moved = owner.moved.get(attr) if owner is not None else None
        if owner is not None and attr in owner.names:
            current, last = f"{current}.{attr}", index
        elif moved is not None:
            current, last = f"{moved[0]}.{moved[1]}", index
        else:
            unported.append(Unported(node.lineno, written, advice_for(here, attr)))
            return None
        break
    if last < 0 or current == root_target + "".join(f".{node.attr}" for node in attrs[:last + 1]):
        return None  # the same path under zerotrain
    node = attrs[last]
    if current.startswith(root_target + ".") and root.end_lineno == node.end_lineno:
        text = "." + current[len(root_target) + 1:]
        return (root.end_lineno, root.end_col_offset), (node.end_lineno, node.end_col_offset), text
    unported.append(Unported(node.lineno, ast.unparse(node), f"`{current}` in zerotrain: import it and use that name"))
    return None


def _port_attributes(source: str, unported: list[Unported]) -> str:
    """`source` with the attribute chains on DeepSpeed names resolved (`_port_chain`); a file that does not
    parse as a whole is left to the import rewriting alone."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    bound = _bindings(tree)
    if not bound:
        return source
    starts = _offsets(source)
    edits, seen = [], set()
    for root, attrs in _chains(tree, bound):
        found: list[Unported] = []
        edit = _port_chain(root, attrs, bound[root.id], found)
        for item in found:
            if (item.line, item.what) not in seen:
                seen.add((item.line, item.what))
                unported.append(item)
        if edit is not None:
            (row, col), (end_row, end_col), text = edit
            line = source[starts[row - 1]:starts[row]]
            # ast's columns count UTF-8 bytes: convert to characters of the line
            begin = len(line.encode("utf-8")[:col].decode("utf-8"))
            end = len(line.encode("utf-8")[:end_col].decode("utf-8"))
            edits.append((starts[row - 1] + begin, starts[row - 1] + end, text))
    for begin, end, text in sorted(edits, reverse=True):
        source = source[:begin] + text + source[end:]
    return source


def rewrite_python(source: str) -> tuple[str, list[Unported]]:
    """`source` with its DeepSpeed imports and attribute chains ported, and what was left as it was. A
    rewrite that would not compile where the original does is not made: the file stays as it is, listed."""
    unported: list[Unported] = []
    original = source
    source = _port_attributes(source, unported)
    new, more = _rewrite_imports(source)
    unported += more
    unported.sort(key=lambda item: item.line)
    try:
        compile(original, "<original>", "exec")
    except SyntaxError:
        return new, unported  # nothing to hold the rewrite to
    try:
        compile(new, "<ported>", "exec")
    except SyntaxError as err:
        unported.append(Unported(err.lineno or 0, f"the rewritten file does not compile ({err.msg})",
                                 "the file is left as it was: port its DeepSpeed lines by hand (and please report "
                                 "this file)"))
        return original, unported
    unported += _left_over(new, {item.line for item in unported})
    unported.sort(key=lambda item: item.line)
    return new, unported


def _left_over(source: str, listed: set[int]) -> list[Unported]:
    """The DeepSpeed imports still in the rewritten `source` that nothing listed yet (a statement the token
    scan did not see as one, e.g. after a compound header over several lines): never passed over silently."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            modules = [node.module or ""]
            if node.module in TRANSFORMERS and any(alias.name in TRANSFORMERS[node.module] for alias in node.names):
                modules.append("deepspeed")
        else:
            continue
        if node.lineno not in listed and any(m == "deepspeed" or m.startswith("deepspeed.") for m in modules):
            found.append(Unported(node.lineno, ast.unparse(node), "this statement was not rewritten: rewrite it by "
                                  "hand with docs/porting.md's table (and please report the file)"))
    return found


def _rewrite_imports(source: str) -> tuple[str, list[Unported]]:
    """`source` with its DeepSpeed import statements ported, and what was left as it was."""
    unported: list[Unported] = []
    starts = _offsets(source)
    pieces, cursor = [], 0
    for (start_row, start_col), (end_row, end_col), first_on_line, comments in _statements(source):
        begin, end = starts[start_row - 1] + start_col, starts[end_row - 1] + end_col
        text = source[begin:end]
        try:
            node = ast.parse(textwrap.dedent(text)).body[0]
        except SyntaxError:
            continue
        if isinstance(node, ast.Import):
            new = _port_import(node, start_row, unported)
        elif isinstance(node, ast.ImportFrom):
            new = _port_from(node, start_row, unported)
        else:
            continue
        if new is None:
            continue
        indent = source[starts[start_row - 1]:begin]
        separator = "\n" + indent if first_on_line and not indent.strip() else "; "
        pieces += [source[cursor:begin], separator.join(new) + "".join(f"  {c}" for c in comments)]
        cursor = end
    pieces.append(source[cursor:])
    return "".join(pieces), unported


# --- shell scripts ---------------------------------------------------------------------------------
_VALUE_OPTIONS = {"--num_gpus": "--nproc", "--num-gpus": "--nproc", "--num_nodes": "--nnodes",
                  "--num-nodes": "--nnodes", "--master_addr": "--master-addr", "--master-addr": "--master-addr",
                  "--master_port": "--master-port", "--master-port": "--master-port", "--node_rank": "--node-rank",
                  "--node-rank": "--node-rank", "--include": "--nproc", "-i": "--nproc"}
_FLAG_OPTIONS = {"--no_local_rank": "--no-local-rank", "--no-local-rank": "--no-local-rank"}
# CPU core binding: placement only, no effect on what runs (torchrun's workers use the cores the OS gives them).
_DROPPED = {"--bind_cores_to_rank": False, "--bind_core_list": True}  # option -> takes a value
# where a `deepspeed` command starts: a line's start (after environment assignments), after `;`, `&`, `|`, `(`,
# after a command word that runs the rest (`nohup`, `time`, `exec`, `eval`, `command`), or at the start of a
# quoted command held in a variable (`run_cmd="deepspeed ..."`, Megatron-DeepSpeed's scripts, run by `eval`)
_LAUNCHER = re.compile(r"(^[ \t]*(?:\w+=\S*[ \t]+)*|[;&|(][ \t]*|\b(?:nohup|time|exec|eval|command)[ \t]+"
                       r"|^[ \t]*\w+=[\"'])(deepspeed)(?=[ \t])", re.M)
# a DeepSpeed launcher started as a Python module: not rewritten, listed
_LAUNCHER_MODULE = re.compile(r"-m[ \t]+deepspeed(?:\.launcher\.(?:runner|launch))?(?=[ \t]|$)", re.M)
# CUDA_VISIBLE_DEVICES=0,1 before the command: DeepSpeed's launcher starts one process per listed device
_VISIBLE = re.compile(r"\bCUDA_VISIBLE_DEVICES=[\"']?([\d,]+)[\"']?[ \t]")


_COUNT_OPTIONS = ("--num_gpus", "--num-gpus", "--include", "-i")
# DeepSpeed's multi-host launcher options, which `zerotrain launch` takes with DeepSpeed's meaning (zerotrain.hostfile):
# a line with a hostfile (or an --include over several hosts) keeps every option as written; only the first word
# changes. Options taking a value, then the flags among them.
_HOSTFILE_VALUE_OPTIONS = frozenset({"--hostfile", "-H", "--include", "-i", "--exclude", "-e", "--num_nodes",
                                     "--num-nodes", "--num_gpus", "--num-gpus", "--num_accelerators", "--launcher",
                                     "--launcher_args", "--launcher-args", "--ssh_port", "--ssh-port",
                                     "--master_addr", "--master-addr", "--master_port", "--master-port"})
_HOSTFILE_FLAGS = frozenset({"--no_local_rank", "--no-local-rank", "--force_multi", "--force-multi"})


def _local_devices() -> tuple[int, str]:
    """(the CUDA devices of the machine running `port`, at least 1; where that number came from)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        return count, f"the {count} CUDA device(s) of the machine that ran zerotrain port"
    return 1, "the machine that ran zerotrain port has no CUDA device, so one process"


def _takes_value(word: str) -> bool:
    """True for a launcher option whose value is the next word."""
    return word in _VALUE_OPTIONS or word in _HOSTFILE_VALUE_OPTIONS or _DROPPED.get(word, False)


def _hosts_line(words: list[tuple[int, int, str]]) -> bool:
    """Whether a launcher line names its hosts (a hostfile, or an --include over several hosts)."""
    for index, (_, _, text) in enumerate(words[:-1]):
        option, _, inline = text.partition("=")
        if option in ("--hostfile", "-H"):
            return True
        if option in ("--include", "-i"):
            value = inline or (words[index + 1][2] if index + 1 < len(words) - 1 else "")
            if _include_count(value) is None:
                return True
    return False


def _include_count(value: str) -> Optional[int]:
    """GPUs named by `--include localhost:0,1` (one host), or None."""
    match = re.fullmatch(r"[\w.-]+:([\d,]+)", value)
    return len(match.group(1).split(",")) if match else None


def rewrite_shell(source: str) -> tuple[str, list[Unported]]:
    """`source` with each `deepspeed` launcher command turned into `zerotrain launch`."""
    unported: list[Unported] = []
    out, cursor = [], 0
    for match in _LAUNCHER.finditer(source):
        line = source.count("\n", 0, match.start(2)) + 1
        start = match.end(2)
        words = []  # (start, end, text) of the launcher's own words, up to the script
        for word in re.finditer(r"\\\n|[^\s\\]+(?:\\.[^\s\\]*)*", source[start:]):
            text = word.group(0)
            if text == "\\\n":
                continue
            if source[start:start + word.start()].count("\n") > source[start:start + word.start()].count("\\\n"):
                break  # the command ended
            words.append((start + word.start(), start + word.end(), text))
            if not text.startswith("-") and (len(words) < 2 or not _takes_value(words[-2][2])):
                break  # the script
        replacements, bad = [], []
        hosts = _hosts_line(words)
        index = 0
        while index < len(words) - 1:
            begin, end, text = words[index]
            option, _, inline = text.partition("=")
            if hosts and option in _HOSTFILE_VALUE_OPTIONS | _HOSTFILE_FLAGS:  # kept as written
                index += 2 if option in _HOSTFILE_VALUE_OPTIONS and not inline else 1
                continue
            if option in _FLAG_OPTIONS:
                replacements.append((begin, end, _FLAG_OPTIONS[option]))
            elif option in _DROPPED:
                takes_value = _DROPPED[option] and not inline
                index += 1 if takes_value else 0
                replacements.append((begin, words[index + 1][0], ""))  # up to the next word: no double space
            elif option in _VALUE_OPTIONS:
                value_word = None if inline else (words[index + 1] if index + 1 < len(words) - 1 else None)
                value = inline or (value_word[2] if value_word else "")
                new = _VALUE_OPTIONS[option]
                if option in ("--include", "-i"):
                    count = _include_count(value)
                    if count is None:
                        bad.append(text)
                    value = str(count)
                stop = value_word[1] if value_word else end
                replacements.append((begin, stop, f"{new} {value}"))
                index += 1 if value_word else 0
            elif text.startswith("-"):
                bad.append(text)
            index += 1
        if bad:
            unported.append(Unported(line, "deepspeed launcher option(s) " + " ".join(bad),
                                     "zerotrain launch takes --nproc, --nnodes, --node-rank, --master-addr, "
                                     "--master-port, --no-local-rank and DeepSpeed's --hostfile, --include, "
                                     "--exclude, --num_nodes, --num_gpus, --launcher, --launcher_args, --ssh_port, --force_multi; "
                                     + NOT_PROVIDED["deepspeed.launcher.runner"]))
            continue
        counted = hosts or any(text.partition("=")[0] in _COUNT_OPTIONS for _, _, text in words[:-1])
        if counted:  # a hostfile's slots count the processes
            out.append(source[cursor:match.start(2)] + "zerotrain launch")
        elif _visible_count(source, match) is not None:  # DeepSpeed: --include localhost:<the visible devices>
            out.append(source[cursor:match.start(2)] + f"zerotrain launch --nproc {_visible_count(source, match)}")
        else:  # DeepSpeed's launcher starts one process per local device: the count is a guess here, said so
            count, where = _local_devices()
            out.append(source[cursor:match.start(2)] + f"zerotrain launch --nproc {count}")
            unported.append(Unported(line, "deepspeed launcher line without --num_gpus",
                                     f"DeepSpeed starts one process per local device; wrote --nproc {count} ({where});"
                                     " set --nproc N to the processes per node the job needs", kind="check"))
        cursor = start
        for begin, end, text in replacements:
            out.append(source[cursor:begin] + text)
            cursor = end
    out.append(source[cursor:])
    for match in _LAUNCHER_MODULE.finditer(source):
        unported.append(Unported(source.count("\n", 0, match.start()) + 1, f"python {match.group(0)}",
                                 NOT_PROVIDED["deepspeed.launcher.runner"]))
    unported.sort(key=lambda item: item.line)
    return "".join(out), unported


def _visible_count(source: str, match: "re.Match[str]") -> Optional[int]:
    """The devices a `CUDA_VISIBLE_DEVICES=0,1` assignment before the launcher word (on its line) lists, or None."""
    line_start = source.rfind("\n", 0, match.start(2)) + 1
    found = _VISIBLE.search(source[line_start:match.start(2)])
    return len([d for d in found.group(1).split(",") if d]) if found else None
