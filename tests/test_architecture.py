"""The import rules of docs/architecture.md hold in the code (pure static: no module is imported).

Every `import` and `from ... import` in zerotrain/, at module level or inside a function (a lazy
import breaks a rule as much as an eager one), is mapped to the part it comes from and the part
it names; each part may import only the parts its row of the doc's table lists. The table is read
from the doc itself, so the doc and this check cannot drift apart.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zerotrain"
DOC = ROOT / "docs" / "architecture.md"


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
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
    tree = ast.parse(path.read_text(), str(path))
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
    table = distributed_rules()
    assert set(table) <= set(rules()), f"{DOC}: the distributed-rules table names unknown parts"
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = part_of(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
        allowed = table.get(source, set())
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


def engine_probes(path: Path) -> list[tuple[str, int]]:
    """(`getattr`/`hasattr`, line) of every probe of an engine by name in `path`: the first argument is a name
    or attribute called `engine`/`_engine`, possibly nested (`getattr(getattr(engine, "x"), "y")`)."""
    tree = ast.parse(path.read_text(), str(path))

    def is_engine(node) -> bool:
        if isinstance(node, ast.Name):
            return node.id in ENGINE_NAMES
        if isinstance(node, ast.Attribute):
            return node.attr in ENGINE_NAMES
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            return is_engine(node.args[0])  # a part of the engine, reached by name
        return False

    return [(node.func.id, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr") and node.args and is_engine(node.args[0])]


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
