"""The import rules of docs/architecture.md hold in the code, with no import cycles (pure static: nothing is imported).

Every `import` and `from ... import` in zerotrain/, at module level or inside a function (a lazy
import breaks a rule as much as an eager one), is mapped to the part it comes from and the part
it names; each part may import only the parts its row of the doc's table lists. The table is read
from the doc itself, so the doc and this check cannot drift apart.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zerotrain"
DOC = ROOT / "docs" / "architecture.md"


def parsed(path: Path) -> ast.Module:
    """The syntax tree of `path`, parsed once per content for all the checks below."""
    return _parse(path.read_text(), str(path))


@functools.lru_cache(maxsize=None)
def _parse(text: str, filename: str) -> ast.Module:
    return ast.parse(text, filename)


def rules() -> dict[str, set[str]]:
    """part -> the parts it may import, from the table between the doc's import-rules markers."""
    text = DOC.read_text()
    match = re.search(r"<!-- import-rules -->(.*?)<!-- /import-rules -->", text, re.S)
    assert match, f"{DOC}: no <!-- import-rules --> table"
    table: dict[str, set[str]] = {}
    for line in match.group(1).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue  # header, separator
        table[cells[0].strip("`")] = set(re.findall(r"`([\w.]+)`", cells[1]))
    return table


def part_of(module: str) -> str:
    """`zerotrain.zero.stage3.fetch` -> `zero`; `zerotrain.engine` -> `engine`; `zerotrain` -> `zerotrain`."""
    parts = module.split(".")
    if len(parts) == 1:
        return "zerotrain"
    name = parts[1]
    if not (PACKAGE / name).is_dir() and not (PACKAGE / f"{name}.py").is_file():
        return "zerotrain"  # a name defined in zerotrain/__init__.py (`from .. import __version__`)
    return name


def imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every zerotrain import in `path`, lazy ones included."""
    package = list(path.relative_to(ROOT).parts[:-1])  # what `from .` means here, module or __init__
    found = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - (node.level - 1)])
                if node.module:
                    found.append((f"{base}.{node.module}", node.lineno))
                else:
                    found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
            elif node.module:
                found.append((node.module, node.lineno))
    return [(name, line) for name, line in found if name == "zerotrain" or name.startswith("zerotrain.")]


def test_the_doc_lists_every_part():
    table = rules()
    parts = {"zerotrain"} | {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | \
        {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert parts - set(table) == set(), f"parts missing from the import-rules table of {DOC}"
    assert set(table) - parts == set(), f"{DOC} lists parts that do not exist"
    unknown = {name for allowed in table.values() for name in allowed} - parts
    assert unknown == set(), f"{DOC}: the table allows imports of unknown parts"


def test_every_import_follows_the_rules():
    table = rules()
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = part_of(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
        for name, line in imports(path):
            target = part_of(name)
            if target != source and target not in table[source]:
                broken.append(f"{path.relative_to(ROOT)}:{line}: {source} imports {name} ({target})")
    assert broken == [], "imports that docs/architecture.md forbids:\n" + "\n".join(broken)


QUESTIONS = {"is_available", "is_initialized", "get_rank", "get_world_size", "get_backend", "get_process_group_ranks"}


def distributed_rules() -> dict[str, set[str]]:
    """part -> what it may call in torch.distributed besides the questions, from the doc's second table."""
    text = DOC.read_text()
    match = re.search(r"<!-- distributed-rules -->(.*?)<!-- /distributed-rules -->", text, re.S)
    assert match, f"{DOC}: no <!-- distributed-rules --> table"
    table: dict[str, set[str]] = {}
    for line in match.group(1).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        table[cells[0].strip("`")] = set(re.findall(r"`([\w.*]+)`", cells[1]))
    return table


def distributed_calls(path: Path) -> list[tuple[str, int]]:
    """(function, line) of every call into torch.distributed in `path`, whatever it is imported as."""
    tree = parsed(path)
    aliases = {}  # local dotted name -> what it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    aliases[root] = root
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def dotted(node) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            if name and name.startswith("torch.distributed.") and not name.startswith("torch.distributed.run"):
                calls.append((name.removeprefix("torch.distributed."), node.lineno))
    return calls


def test_only_comm_calls_torch_distributed_collectives():
    """Per part, or per module where the table has a row for it (`comm.core`: Comm, the one caller)."""
    table = distributed_rules()
    assert {name.split(".")[0] for name in table} <= set(rules()), f"{DOC}: the distributed-rules table names unknown parts"
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        source = part_of(module)
        allowed = table.get(module.removeprefix("zerotrain."), table.get(source, set()))
        for name, line in distributed_calls(path):
            if "*" in allowed or name in QUESTIONS or name in allowed:
                continue
            broken.append(f"{path.relative_to(ROOT)}:{line}: {source} calls torch.distributed.{name}")
    assert broken == [], "calls into torch.distributed that docs/architecture.md forbids:\n" + "\n".join(broken)


def test_the_distributed_check_sees_every_alias(tmp_path):
    """The check can fail: each way of reaching torch.distributed is seen."""
    source = tmp_path / "sample.py"
    source.write_text("import torch\nimport torch.distributed as d\nfrom torch import distributed\n"
                      "from torch.distributed import all_reduce as ar\n"
                      "torch.distributed.barrier()\nd.all_reduce(x)\ndistributed.broadcast(x, 0)\nar(x)\n"
                      "d.get_rank()\n")
    assert [name for name, _ in distributed_calls(source)] == ["barrier", "all_reduce", "broadcast", "all_reduce",
                                                                "get_rank"]


# -- trainers use the TrainingEngine Protocol: no probing the engine by name -----------------------------------

ENGINE_NAMES = {"engine", "_engine"}  # `engine`, `self.engine`, `self._engine`, `trainer.engine`, ...


def probes(path: Path, names: set) -> list[tuple[str, int]]:
    """(`getattr`/`hasattr`, line) of every probe by name, in `path`, of an object held under one of `names`
    (a name or attribute, `_` prefix or not, indexed or not: `engine`, `self._engine`, `self.buckets[i]`), also
    nested (`getattr(getattr(engine, "x"), "y")`: both)."""
    def held_as(node) -> str:
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Name):
            return node.id.lstrip("_")
        if isinstance(node, ast.Attribute):
            return node.attr.lstrip("_")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            return held_as(node.args[0])  # a part of it, reached by name
        return ""

    return [(node.func.id, node.lineno) for node in ast.walk(parsed(path))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr") and node.args and held_as(node.args[0]) in names]


def engine_probes(path: Path) -> list[tuple[str, int]]:
    """Probes of an engine by name in `path` (`engine`, `self.engine`, `self._engine`, nested getattrs)."""
    return probes(path, ENGINE_NAMES)


def test_nothing_outside_the_engine_probes_it_by_name():
    """Trainers and commands call the members `zerotrain.training_engine.TrainingEngine` declares (optional
    ones have defaults), so nothing outside the engine part asks whether the engine has an attribute."""
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if part_of(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")) == "engine":
            continue
        broken += [f"{path.relative_to(ROOT)}:{line}: {probe}(engine, ...)" for probe, line in engine_probes(path)]
    assert broken == [], "probes of the engine outside it (declare the member in TrainingEngine):\n" + "\n".join(broken)


def test_the_probe_check_can_fail(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("a = getattr(engine, 'config', None)\nb = hasattr(self.engine, 'eval')\n"
                      "c = getattr(getattr(self._engine, 'checkpointer', None), 'pending', False)\n"
                      "d = getattr(self.dataloader, 'sampler', None)\ne = engine.config\n")
    assert sorted(engine_probes(source)) == [("getattr", 1), ("getattr", 3), ("getattr", 3), ("hasattr", 2)]
    # and probes between parts (test_no_part_probes_another_by_name)
    source.write_text("a = hasattr(reducer, 'release_final_shards')\nb = getattr(self.buckets[i], 'offloaded', 0)\n"
                      "c = getattr(optimizer.comm, 'rank', 0)\nd = getattr(part, 'store', None)\n"
                      "e = getattr(self.dataloader, 'sampler', None)\nf = getattr(model, 'config', None)\n")
    assert sorted(part_probes(source)) == [("getattr", 2), ("getattr", 3), ("getattr", 4), ("hasattr", 1)]


# -- nor do the parts probe each other: a capability is a declared member (zero/interfaces.py, ShardLayout) -----

# What the parts hold each other as (`reducer`, `self.zero_optimizer`, `self.buckets[i]`, `part.owner`, ...).
PART_NAMES = {"reducer", "zero_optimizer", "fetcher", "param_store", "store", "comm", "part", "parts", "bucket",
              "buckets", "records", "stream", "checkpointer", "weights", "owner", "fence", "fences", "loss_scaler",
              "reduce", "timers", "monitor", "monitors"}


def part_probes(path: Path) -> list[tuple[str, int]]:
    """Probes of a part by name in `path` (`hasattr(reducer, "x")`, `getattr(self.buckets[i], "x", False)`,
    `getattr(optimizer.comm, "rank", 0)`)."""
    return probes(path, PART_NAMES)


def test_no_part_probes_another_by_name():
    broken = [f"{path.relative_to(ROOT)}:{line}: {probe}(...)" for path in sorted(PACKAGE.rglob("*.py"))
              for probe, line in part_probes(path)]
    assert broken == [], "probes of a part by name (declare the member in its interface):\n" + "\n".join(broken)


# -- no import cycles ------------------------------------------------------------------------------------------
#
# Module by module: every import counts, lazy ones inside functions too, and importing `a.b.c` also imports the
# packages `a` and `a.b` (their `__init__` runs first), except the packages the importing module is itself in
# (already being imported). Only imports under `if TYPE_CHECKING:` never run and do not count.

# TEMPORARY: the import cycles main still has (issue #32; helper `engine` removes them). Each entry is one
# lazy import that closes a cycle; an entry no longer on a cycle fails the test below, so the list can only
# shrink. Remove it when the cycles are gone.
KNOWN_CYCLE_EDGES: set = set()  # none left: a cycle may only be added here with a reason and a plan to remove it


def _is_module(name: str, root: Path) -> bool:
    where = root / Path(*name.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def runtime_imports(path: Path, root: Path = ROOT) -> list[tuple[str, int]]:
    """(module, line) of every zerotrain module `path` imports when it runs, lazy imports included and
    `if TYPE_CHECKING:` blocks excluded; `from package import name` names the submodule where `name` is one."""
    this = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def type_checking(test: ast.expr) -> bool:
        return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.append((sub if _is_module(sub, root) else module, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(parsed(path))
    return [(name, line) for name, line in found if name == "zerotrain" or name.startswith("zerotrain.")]


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {module it imports, through package `__init__`s too: the line}."""
    graph: dict[str, dict[str, int]] = {}
    for path in sorted((root / "zerotrain").rglob("*.py")):
        this = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        inside = {".".join(this.split(".")[:i]) for i in range(1, this.count(".") + 1)}
        if path.name == "__init__.py":
            inside.add(this)
        edges = graph.setdefault(this, {})
        for name, line in runtime_imports(path, root):
            while not _is_module(name, root) and "." in name:
                name = name.rpartition(".")[0]
            parts = name.split(".")
            for target in [".".join(parts[:i]) for i in range(1, len(parts) + 1)]:  # a.b.c runs a, a.b first
                if target not in inside and target != this:
                    edges.setdefault(target, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph.get(start, ())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_cycles():
    graph = import_graph()
    on_cycles = {module: i for i, group in enumerate(import_cycles(graph)) for module in group}
    stale = [f"{a} -> {b}" for a, b in sorted(KNOWN_CYCLE_EDGES)
             if b not in graph.get(a, {}) or a not in on_cycles or on_cycles.get(a) != on_cycles.get(b)]
    assert stale == [], "KNOWN_CYCLE_EDGES entries no longer on a cycle: remove them\n" + "\n".join(stale)
    allowed = {a: {b: line for b, line in edges.items() if (a, b) not in KNOWN_CYCLE_EDGES}
               for a, edges in graph.items()}
    report = []
    for group in import_cycles(allowed):
        report.append(" <-> ".join(group) + ":\n" + "\n".join(
            f"    {a} imports {b} (line {allowed[a][b]})" for a in group for b in allowed[a] if b in group))
    assert report == [], "import cycles (lazy imports count; only `if TYPE_CHECKING:` ones do not):\n" + \
        "\n".join(report)


def test_the_cycle_check_can_fail(tmp_path):
    """A lazy cycle, a cycle through a package's __init__, and a TYPE_CHECKING import that is not one."""
    files = {
        "zerotrain/__init__.py": "",
        "zerotrain/a.py": "def f():\n    from zerotrain import b\n",  # lazy
        "zerotrain/b.py": "from .a import f\n",
        "zerotrain/p/__init__.py": "from .q import g\n",
        "zerotrain/p/q.py": "def g():\n    pass\n",
        "zerotrain/c.py": "from zerotrain.p.q import g\n",  # runs p/__init__ first ...
        "zerotrain/p/r.py": "import zerotrain.c\n",  # ... which p/__init__ would not import: no cycle yet
        "zerotrain/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zerotrain import e\n",
        "zerotrain/e.py": "from zerotrain import d\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert import_cycles(import_graph(tmp_path)) == [["zerotrain.a", "zerotrain.b"]]
    (tmp_path / "zerotrain/p/__init__.py").write_text("from .q import g\nfrom . import r\n")
    assert sorted(import_cycles(import_graph(tmp_path))) == [
        ["zerotrain.a", "zerotrain.b"], ["zerotrain.c", "zerotrain.p", "zerotrain.p.r"]]


# What a test may import from a command module (`zerotrain/<part>/command.py`): the command's own entry points.
# Anything else there would be a library function living in a CLI; it belongs to the run layer (issue 42).
COMMAND_ENTRY = re.compile(r"add_\w+_parser|check_\w+_args|worker_argv|run_\w+|already_trained|effective_\w+_config")


def command_module_imports(root: Path = ROOT) -> list[str]:
    """`path:line: name` of every import in root/tests that takes from a command module something other than the
    command's entry points (`COMMAND_ENTRY`), or the module itself (`import zerotrain.train.command`)."""
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        if not re.search(r"zerotrain\.\w+\.command|import command\b", path.read_text()):
            continue  # parse only the files that name a command module
        for node in ast.walk(parsed(path)):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                found += [f"{where}: {a.name}" for a in node.names if re.fullmatch(r"zerotrain\.\w+\.command", a.name)]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if re.fullmatch(r"zerotrain\.\w+\.command", node.module):
                    found += [f"{where}: {node.module}.{a.name}" for a in node.names
                              if not COMMAND_ENTRY.fullmatch(a.name)]
                elif re.fullmatch(r"zerotrain\.\w+", node.module):
                    found += [f"{where}: {node.module}.command" for a in node.names if a.name == "command"]
    return found


def test_no_test_imports_a_library_function_from_a_command_module():
    """Issue 42: the commands are argument parsing and a call into the run layer; tests import library functions
    from where they live (`zerotrain.run`, ...), never from `zerotrain/<part>/command.py`."""
    assert command_module_imports() == [], "tests importing from command modules what is no entry point:\n" + \
        "\n".join(command_module_imports())


def test_the_command_import_check_can_fail(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "from zerotrain.train.command import worker_argv, train_model\n"
        "def f():\n    from zerotrain.embedding.command import run_train_embedding, _config\n"
        "    import zerotrain.merge.command\n    from zerotrain.train import command\n"
        "    from zerotrain.command import CLIError\n")
    assert command_module_imports(tmp_path) == [
        "tests/test_x.py:1: zerotrain.train.command.train_model",
        "tests/test_x.py:3: zerotrain.embedding.command._config",
        "tests/test_x.py:4: zerotrain.merge.command",
        "tests/test_x.py:5: zerotrain.train.command"]
