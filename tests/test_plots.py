"""Plots read metrics.jsonl files (resumed runs included) and write a PNG."""
from __future__ import annotations

import json

import pytest

from zerotrain.cli import main
from zerotrain.plots import PNG_PANELS, plot_runs, read_metrics


def write_metrics(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_read_metrics_keeps_the_last_record_of_a_step(tmp_path):
    run = tmp_path / "run"
    write_metrics(run / "metrics.jsonl", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5},
                                          {"step": 2, "loss": 2.4}, {"step": 3, "loss": 2.0, "eval_loss": 2.2}])
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["loss"] == 2.4


def test_bad_metrics_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file at .*metrics.jsonl"):
        read_metrics(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 1.0}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON record"):
        read_metrics(bad)


def test_plot_two_runs(tmp_path):
    import matplotlib  # noqa: F401 - in the dev extra: a missing install fails, never skips
    for name, offset in (("a", 0.0), ("b", 0.3)):
        write_metrics(tmp_path / name / "metrics.jsonl",
                      [{"step": s, "loss": 3.0 - 0.1 * s + offset, "lr": 1e-3, "tokens_per_s": 1000.0 + s,
                        **({"eval_loss": 3.1 - 0.1 * s} if s % 5 == 0 else {})} for s in range(1, 21)])
    out = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "plots" / "cmp.png", labels=["a", "b"])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "x.png", labels=["a"])


def test_plot_command_writes_a_png_per_panel_with_runs_overlaid(tmp_path, capsys):
    import matplotlib  # noqa: F401 - in the dev extra: a missing install fails, never skips
    for name, ranks in (("a", 2), ("b", 1)):
        write_metrics(tmp_path / name / "metrics.jsonl",
                      [{"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-3 * s, "tokens_per_s": 900.0 + s,
                        "memory_bytes": [2**28 + 2**20 * (s + r) for r in range(ranks)], "memory_kind": "peak_rss",
                        **({"eval_loss": 3.1 - 0.1 * s} if s % 4 == 0 else {})} for s in range(1, 13)])
    assert main(["plot", str(tmp_path / "a")]) == 0  # the first run's own plots
    own = {path: open(path, "rb").read() for path in capsys.readouterr().out.split()}
    assert sorted(own) == sorted(str(tmp_path / "a" / "plots" / f"{stem}.png") for stem in PNG_PANELS)
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    written = capsys.readouterr().out.split()
    # the runs together get their own name: a's own PNGs stay a's (issue 47: they were overwritten)
    assert sorted(written) == sorted(str(tmp_path / "a" / "plots" / "compare_a_b" / f"{stem}.png")
                                     for stem in PNG_PANELS)
    assert all(open(path, "rb").read() == data for path, data in own.items())
    for path in written:
        data = open(path, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, path
    # metrics without memory (written before it was recorded): no memory.png; a missing run is one error line
    write_metrics(tmp_path / "old" / "metrics.jsonl", [{"step": 1, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 5.0}])
    assert main(["plot", str(tmp_path / "old"), "--out", str(tmp_path / "o")]) == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["loss.png", "lr.png", "tokens_per_s.png"]
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "no metrics file" in capsys.readouterr().err
