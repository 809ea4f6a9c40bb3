"""`python -m tools.mutate` finds a planted gap in a tiny module and always gives the file back unchanged."""
from __future__ import annotations

import os
import pytest

from tools import mutate

MODULE = '''\
"""A clip factor: max_norm / |norm| when the norm is larger than max_norm, else 1."""


def clip_factor(norm: float, max_norm: float) -> float:
    if abs(norm) > max_norm:
        return max_norm / abs(norm)
    return 1.0
'''

# the planted gap: no negative norm is ever checked, so dropping either `abs` survives
TESTS = '''\
from clip import clip_factor


def test_clip_factor():
    assert clip_factor(4.0, 1.0) == 0.25
    assert clip_factor(0.5, 1.0) == 1.0
'''


@pytest.fixture
def planted(tmp_path):
    (tmp_path / "clip.py").write_text(MODULE)
    (tmp_path / "test_clip.py").write_text(TESTS)
    return tmp_path


def test_mutants_are_the_plausible_bugs_and_compile():
    found = {(m.operator, m.original, m.replacement) for m in mutate.mutants_of("clip.py", MODULE.encode())}
    assert ("drop abs", "abs(norm)", "norm") in found
    assert ("compare", "abs(norm) > max_norm", "(abs(norm) >= max_norm)") in found
    assert ("drop right operand", "max_norm / abs(norm)", "max_norm") in found
    assert ("constant", "1.0", "2.0") in found
    ids = [m.id for m in mutate.mutants_of("clip.py", MODULE.encode())]
    assert len(ids) == len(set(ids))
    # a docstring, an annotation and an f-string message are not mutated
    source = 'def f(x: int = 1) -> int:\n    """Doc 1."""\n    raise ValueError(f"bad {x + 1}")\n'
    assert [(m.original, m.replacement) for m in mutate.mutants_of("f.py", source.encode())] == \
        [("1", "0"), ("1", "2")]


def test_finds_the_planted_gap_and_restores_the_file(planted, capsys):
    module = planted / "clip.py"
    before = module.stat().st_mtime_ns
    # (four of the mutants, each a pytest process: the tool's own test stays within seconds)
    chosen = [m.id for m in mutate.mutants_of(str(module), MODULE.encode())
              if (m.operator, m.original) in {("drop abs", "abs(norm)"), ("drop right operand", "max_norm / abs(norm)"),
                                              ("constant", "1.0")}]
    assert len(chosen) == 4
    code = mutate.main([str(module), "--tests", str(planted / "test_clip.py"), "--timeout", "60", "--only", *chosen])
    out = capsys.readouterr().out
    assert code == 1  # survivors
    assert "4 run, 2 killed (0 by timeout), 0 equivalent, 2 survived: score 50%" in out, out
    assert "SURVIVED" in out and "drop abs" in out and f"{module}:5" in out
    assert "-    if abs(norm) > max_norm:" in out and "+    if norm > max_norm:" in out  # the diff
    assert module.read_text() == MODULE and module.stat().st_mtime_ns == before
    assert not (planted / ("clip.py" + mutate.BACKUP_SUFFIX)).exists()


def test_equivalent_ids_are_not_run_nor_counted(planted, capsys):
    module = planted / "clip.py"
    survivors = [m for m in mutate.mutants_of(str(module), MODULE.encode()) if m.operator == "drop abs"]
    listing = planted / "equivalents.txt"
    listing.write_text("# id  file  reason\n" + "".join(f"{m.id}  clip.py  planted\n" for m in survivors))
    code = mutate.main([str(module), "--tests", str(planted / "test_clip.py"), "--timeout", "60",
                        "--equivalents", str(listing), "--only", *[m.id for m in survivors]])
    assert code == 0, capsys.readouterr().out
    assert f"{len(survivors)} equivalent, 0 survived" in capsys.readouterr().out


def test_the_file_comes_back_after_an_interrupt_or_a_killed_run(planted):
    module = planted / "clip.py"
    with pytest.raises(KeyboardInterrupt):
        with mutate.MutatedFile(module) as put:
            put(b"broken = (\n")
            assert (planted / ("clip.py" + mutate.BACKUP_SUFFIX)).exists()
            raise KeyboardInterrupt
    assert module.read_text() == MODULE
    # a run killed -9 leaves the copy: the next run puts it back first
    (planted / ("clip.py" + mutate.BACKUP_SUFFIX)).write_text(MODULE)
    module.write_text("mutated = 1\n")
    assert mutate.restore_backup(module) and module.read_text() == MODULE
    assert not (planted / ("clip.py" + mutate.BACKUP_SUFFIX)).exists()
    # while a live run has the file mutated (its pid beside it), nothing takes the file from it
    (planted / ("clip.py" + mutate.BACKUP_SUFFIX)).write_text(MODULE)
    (planted / ("clip.py" + mutate.LOCK_SUFFIX)).write_text(str(os.getppid()))
    module.write_text("mutated = 1\n")
    with pytest.raises(RuntimeError, match="being mutated by another run"):
        mutate.restore_backup(module)
    assert module.read_text() == "mutated = 1\n"


def _found(source: str) -> set[tuple[str, str, str]]:
    mutants = mutate.mutants_of("m.py", source.encode())
    for mutant in mutants:  # every mutant still compiles
        compile(mutant.apply(source.encode()), "m.py", "exec")
    return {(m.operator, m.original, m.replacement) for m in mutants}


def test_same_type_arguments_are_swapped_beyond_the_first_two():
    found = _found("def f(a, b, c):\n    g(a, b, c)\n    h(x=a, y=b, z=1)\n    k(a, b, 2)\n")
    swaps = {(o, r) for op, o, r in found if op == "swap same-type arguments"}
    assert swaps == {("g(a, b, c)", "g(a, c, b)"),  # positions 1-2 (0-1 is "swap arguments")
                     ("h(x=a, y=b, z=1)", "h(x=b, y=a, z=1)")}  # keywords; `b` and `1` or `b` and `2`: other kinds
    assert ("swap arguments", "g(a, b, c)", "g(b, a, c)") in found


def test_dict_keys_keywords_and_subscripts_get_a_sibling_name():
    found = _found('ROWS = {"fp16": 1, "bf16": 2, "seed": 3}\n'
                   'def f(cfg, n):\n'
                   '    Config(eval_steps=n)\n'
                   '    Config(eval_batches=n, seed=1)\n'
                   '    return cfg["train_micro_batch"] + cfg.get("train_batch", 0) + n["x"]\n')
    siblings = {(o, r) for op, o, r in found if op == "sibling key"}
    # dict keys: the next key (the last takes the one before)
    assert {('"fp16"', "'bf16'"), ('"bf16"', "'seed'"), ('"seed"', "'bf16'")} <= siblings
    # keywords: another keyword the module passes to the same callee, the one sharing the longest prefix;
    # never one the call passes already (a SyntaxError)
    assert ("Config(eval_steps=n)", "Config(eval_batches=n)") in siblings
    assert ("Config(eval_batches=n, seed=1)", "Config(eval_steps=n, seed=1)") in siblings
    assert ("Config(eval_batches=n, seed=1)", "Config(eval_batches=n, eval_steps=1)") in siblings
    assert not any(r.count("seed=") > 1 or r.count("eval_batches=") > 1 for _, r in siblings)
    # string keys read on the same object (`[]` and `.get`); `n` has one key only: no sibling
    assert {('"train_micro_batch"', "'train_batch'"), ('"train_batch"', "'train_micro_batch'")} <= siblings
    assert not any(o == '"x"' for o, _ in siblings)


def test_one_term_of_a_boolean_rule_is_dropped():
    found = _found("def f(a, b, c):\n    return a or b or c\n")
    drops = {r for op, o, r in found if op == "drop bool term"}
    assert drops == {"(b or c)", "(a or c)", "(a or b)"}
    assert {r for op, o, r in _found("def f(a, b):\n    return a and b\n") if op == "drop bool term"} == {"a", "b"}


def test_boundaries_move_and_unused_results_are_dropped():
    found = _found("async def f(a, b):\n    if a < b:\n        g(a)\n    await h(b)\n    x = k(a)\n"
                   "    return a >= b\n")
    assert ("compare", "a < b", "(a <= b)") in found and ("compare", "a >= b", "(a > b)") in found
    assert ("drop call", "g(a)", "pass") in found and ("drop call", "await h(b)", "pass") in found
    assert not any(o == "x = k(a)" or o == "k(a)" and r == "pass" for _, o, r in found)  # its result is used


def test_generated_text_loses_an_indent():
    source = 'def f(name):\n    g("if x:\\n    y = 1\\n")\n    return f"def {name}():\\n      pass\\n"\n'
    found = _found(source)
    indents = {(o, r) for op, o, r in found if op == "drop indent"}
    assert ('"if x:\\n    y = 1\\n"', "'if x:\\ny = 1\\n'") in indents
    assert ('f"def {name}():\\n      pass\\n"', "(f'def {name}():\\n  pass\\n')") in indents
    # text without an indented line has none to lose; the module's docstring is not generated text
    assert not [m for m in mutate.mutants_of("m.py", b'"""Doc.\n\n    indented\n"""\nA = "a\\nb"\n')
                if m.operator == "drop indent"]
