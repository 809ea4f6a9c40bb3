"""Plots read metrics.jsonl files (resumed runs included) and write a PNG."""
from __future__ import annotations

import json
from pathlib import Path

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


@pytest.fixture
def drawn(monkeypatch):
    """What each saved figure shows, by file name: per axes its title, labels, lines (label, x, y, style, colour),
    the phase bands' rectangles, the y tick labels, the limits and the height on the page; `shared` names the
    figures whose two axes share the x axis. Recorded as `savefig` writes the PNG."""
    from matplotlib.figure import Figure

    figures: dict = {}
    save = Figure.savefig

    def savefig(self, path, *args, **kwargs):
        axes = []
        for axis in self.axes:
            axes.append({
                "title": axis.get_title(), "xlabel": axis.get_xlabel(), "ylabel": axis.get_ylabel(),
                "lines": [(line.get_label(), list(line.get_xdata()), list(line.get_ydata()), line.get_linestyle(),
                           line.get_color()) for line in axis.get_lines()],
                "legend": [text.get_text() for text in axis.get_legend().get_texts()] if axis.get_legend() else None,
                "bands": [[tuple(round(float(v), 6) for v in (*path.vertices.min(axis=0), *path.vertices.max(axis=0)))
                           for path in collection.get_paths()] for collection in axis.collections],
                "yticklabels": [label.get_text() for label in axis.get_yticklabels()],
                "xlim": tuple(map(float, axis.get_xlim())), "ylim": tuple(map(float, axis.get_ylim())),
                "height": axis.get_position().height})
        shared = len(self.axes) == 2 and self.axes[0].get_shared_x_axes().joined(self.axes[0], self.axes[1])
        figures[Path(path).name] = {"axes": axes, "shared_x": shared}
        return save(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def test_plot_runs_draws_each_runs_series_labelled(tmp_path, drawn):
    """`plot_runs`: per panel one line per run at the records' steps (a non-finite or missing value left out),
    the loss labelled "train" with the held-out loss beside it in the same colour; the missing directories made,
    written again into them."""
    write_metrics(tmp_path / "a" / "metrics.jsonl",
                  [{"step": 1, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 10.0, "eval_loss": 3.5},
                   {"step": 2, "loss": float("nan"), "lr": 2e-3, "tokens_per_s": 12.0},
                   {"step": 3, "loss": 2.0, "lr": "x", "eval_loss": 2.5}])
    write_metrics(tmp_path / "b" / "metrics.jsonl", [{"step": 1, "loss": 4.0, "lr": 1e-4, "tokens_per_s": 20.0}])
    for _ in range(2):  # two missing directories made the first time, there the second time
        plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "out" / "deep" / "cmp.png")
    loss, lr, speed = drawn["cmp.png"]["axes"]
    assert [(title["title"], title["xlabel"]) for title in (loss, lr, speed)] == [
        ("loss (nats/token)", "optimizer step"), ("learning rate", "optimizer step"), ("tokens/s", "optimizer step")]
    (a_train, ax, ay, _, a_colour), (a_eval, ex, ey, style, e_colour), (b_train, bx, by, _, _) = loss["lines"]
    assert (a_train, ax, ay, b_train, bx, by) == ("a train", [1, 3], [3.0, 2.0], "b train", [1], [4.0])
    assert (a_eval, ex, ey, style, e_colour) == ("a held-out", [1, 3], [3.5, 2.5], "--", a_colour)
    assert loss["legend"] == ["a train", "a held-out", "b train"]
    assert [line[:3] for line in lr["lines"]] == [("a", [1, 2], [1e-3, 2e-3]), ("b", [1], [1e-4])]
    assert [line[:3] for line in speed["lines"]] == [("a", [1, 2], [10.0, 12.0]), ("b", [1], [20.0])]


def test_memory_timelines_draw_each_series_and_labelled_phase_bands_in_rank_order(tmp_path, drawn):
    """`plot_memory_timelines`: ranks in numeric order (rank 10 after rank 2), the memory series in GiB over
    time above one labelled band per phase (in the phase order, nested and repeated spans each drawn), the two
    panels sharing the time axis, the memory panel three times the band's height."""
    from zerotrain.plots import plot_memory_timelines

    gib = 2**30
    for rank in (10, 2, 1):
        samples = [{"t": 0.0, "rss": 1 * gib, "cuda_allocated": 2 * gib},
                   {"t": 0.5, "rss": 3 * gib, "boundary": "backward", "event": "begin"},
                   {"t": 1.0, "rss": 2 * gib, "boundary": "forward", "event": "begin"},
                   {"t": 1.5, "rss": 2 * gib, "boundary": "forward", "event": "end"},
                   {"t": 2.0, "rss": 2 * gib, "boundary": "backward", "event": "end"},
                   {"t": 2.5, "rss": 2 * gib, "boundary": "forward", "event": "begin"},
                   {"t": 4.0, "rss": 5 * gib, "boundary": "forward", "event": "end"}]
        header = {"rank": rank, "device": "cpu", "interval_s": 0.1}
        write_metrics(tmp_path / f"memory_timeline.rank{rank}.jsonl", [header, *samples])
    written = plot_memory_timelines(tmp_path, tmp_path / "plots", prefix="p_")
    assert [path.name for path in written] == [f"p_memory_timeline_rank{rank}.png" for rank in (1, 2, 10)]
    figure = drawn["p_memory_timeline_rank2.png"]
    memory, phases = figure["axes"]
    assert memory["title"] == "memory timeline, rank 2 (cpu)" and memory["ylabel"] == "GiB"
    assert [line[:3] for line in memory["lines"]] == [
        ("host RSS", [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 4.0], [1.0, 3.0, 2.0, 2.0, 2.0, 2.0, 5.0]),
        ("CUDA allocated", [0.0], [2.0])]
    assert phases["yticklabels"] == ["forward", "backward"]
    forward, backward = phases["bands"]
    assert forward == [(1.0, 0.1, 1.5, 0.9), (2.5, 0.1, 4.0, 0.9)]
    assert backward == [(0.5, 1.1, 2.0, 1.9)]
    assert phases["ylim"] == (0.0, 2.0) and phases["xlim"] == (0.0, 4.0)
    assert figure["shared_x"] and memory["xlim"] == (0.0, 4.0)
    assert memory["height"] == pytest.approx(3 * phases["height"], rel=0.05)
