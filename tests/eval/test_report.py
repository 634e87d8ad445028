"""`vla-rl report`: reading metrics files, the run summary against hand-computed values, the figures."""

import json
from pathlib import Path

import pytest

from vla_rl.cli import main as cli_main
from vla_rl.eval.report import ReportError, Run, summarize_run, summary_table, write_report


def _write_run(path, evals, *, iteration_s=10.0, steps_per_iter=1000, torn=False):
    """A run folder whose evaluations read ``evals`` at iterations 0, 1, 2, ... (one per iteration)."""
    path.mkdir(parents=True)
    lines = []
    for it, s in enumerate(evals):
        rec = {"iteration": it, "time/env_steps": it * steps_per_iter, "eval/success_once": s}
        if it:
            rec.update({"time/iteration_s": iteration_s, "losses/approx_kl": 0.01 * it, "losses/clipfrac": 0.1,
                        "losses/value": 1.0 / it, "losses/explained_variance": 0.5,
                        "rollout/success_once": s})
        lines.append(json.dumps(rec))
    text = "\n".join(lines) + "\n"
    if torn:
        text += '{"iteration": 99, "time/env'
    (path / "metrics.jsonl").write_text(text)
    return path


def test_summary_of_a_hand_made_run(tmp_path):
    run = Run.load(_write_run(tmp_path / "a", [0.5, 0.7, 0.92, 0.95, 0.9]))
    s = summarize_run(run)
    assert (s.evaluations, s.first, s.final, s.best) == (5, 0.5, 0.9, 0.95)
    assert (s.best_iteration, s.best_steps, s.best_seconds) == (3, 3000.0, 30.0)
    # 90 % is first reached at iteration 2: 2000 steps, two timed iterations of 10 s
    assert (s.target_iteration, s.target_steps, s.target_seconds) == (2, 2000.0, 20.0)
    never = summarize_run(Run.load(_write_run(tmp_path / "b", [0.1, 0.3, 0.3])))
    assert never.target_iteration is None and never.best == 0.3 and never.best_iteration == 1  # first of ties
    table = summary_table([s, never])
    assert "| a | 5 | 0.500 | 0.900 | 0.950 | 3 / 3k / 0.5 min | 2 / 2k / 0.3 min |" in table
    assert "not reached" in table


def test_torn_last_line_is_skipped_but_a_broken_middle_line_is_an_error(tmp_path):
    run_dir = _write_run(tmp_path / "torn", [0.2, 0.4], torn=True)
    assert [r["iteration"] for r in Run.load(run_dir).records] == [0, 1]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"iteration": 0}\nnot json\n{"iteration": 1}\n')
    with pytest.raises(ReportError, match="metrics.jsonl line 2 is not a metrics record"):
        Run.load(bad)
    with pytest.raises(ReportError, match="no metrics file"):
        Run.load(tmp_path / "nowhere")


def test_report_writes_figures_and_markdown(tmp_path):
    a = _write_run(tmp_path / "runs" / "seed0", [0.5, 0.8, 0.9])
    b = _write_run(tmp_path / "other" / "seed0", [0.4, 0.6, 0.7])
    with pytest.raises(ReportError, match="both named"):
        write_report([a, b], tmp_path / "r0")
    path, _ = write_report([a, b], tmp_path / "r1", names=["noise", "sde"])
    text = path.read_text()
    assert "| noise | 3 |" in text and "| sde | 3 |" in text
    for png in ("success_vs_steps.png", "success_vs_time.png", "diagnostics.png"):
        data = (tmp_path / "r1" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"]({png})" in text


def test_report_cli(tmp_path, capsys):
    a = _write_run(tmp_path / "a", [0.5, 0.95])
    assert cli_main(["report", str(a), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "| a | 2 | 0.500 | 0.950 |" in out and (tmp_path / "rep" / "report.md").is_file()
    assert cli_main(["report", str(tmp_path / "missing"), "--out", str(tmp_path / "rep2")]) == 2
    assert "no metrics file" in capsys.readouterr().err


def test_report_cli_takes_out_and_names_as_settings_like_the_other_commands(tmp_path, capsys):
    """`vla-rl report RUN out=DIR` (the form train / eval / bench take) writes into DIR, not a run named "out=DIR"."""
    a = _write_run(tmp_path / "a", [0.5, 0.95])
    assert cli_main(["report", str(a), f"out={tmp_path / 'rep'}", "names=first"]) == 0
    assert "| first | 2 | 0.500 | 0.950 |" in capsys.readouterr().out
    assert (tmp_path / "rep" / "report.md").is_file() and not (tmp_path / "runs").exists()
    assert cli_main(["report", str(a), f"out={tmp_path / 'r3'}", "--out", str(tmp_path / "r2")]) == 2
    assert "out is given twice" in capsys.readouterr().err
    assert cli_main(["report", f"out={tmp_path / 'r4'}"]) == 2
    assert "give at least one run folder" in capsys.readouterr().err


def test_step_tick_labels_never_overlap(tmp_path, monkeypatch):
    """Env-step ticks read 40k / 1.2M; plain six-digit labels (a 150k-step run: 0, 25000, ..., 175000) overlapped in
    a diagnostics panel. Checked on the drawn figures."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from vla_rl.eval.report import plot_runs

    crowded = []
    savefig = Figure.savefig

    def check(fig, fname, *a, **k):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
            if any(left.x1 > right.x0 for left, right in zip(boxes, boxes[1:])):
                crowded.append((str(fname), ax.get_title(), [t.get_text() for t in ax.get_xticklabels()]))
        return savefig(fig, fname, *a, **k)

    monkeypatch.setattr(Figure, "savefig", check)
    for top in (150_000, 1_260_000):
        recs = [{"iteration": i, "time/env_steps": top * i // 100, "time/wall_s": 30.0 * i, "eval/success_once": 0.5,
                 "rollout/success_once": 0.5, "losses/approx_kl": 0.01} for i in range(1, 101)]
        plot_runs([Run("run", recs)], tmp_path / str(top))
    assert crowded == []


def test_report_on_a_full_disk_keeps_the_previous_report_whole(tmp_path, monkeypatch, capsys):
    """The report folder is written aside and renamed into place: a full disk half-way through the second figure
    leaves the previous report whole (every file as it was, not half old and half new), no stray temporary
    folder, and a `file error` naming the path (exit 2). The report's own earlier folder is rewritten without
    --overwrite; a folder of other files, or a report folder beside files a report does not write, needs it."""
    import errno
    import os

    from matplotlib.figure import Figure

    a = _write_run(tmp_path / "a", [0.5, 0.95])
    rep = tmp_path / "rep"
    assert cli_main(["report", str(a), "--out", str(rep)]) == 0
    before = {p.name: p.read_bytes() for p in rep.iterdir()}
    real, calls = Figure.savefig, []

    def savefig(self, fname, *args, **kw):
        calls.append(fname)
        if len(calls) == 2:   # the second figure: half a PNG, then the disk is full
            Path(fname).write_bytes(before["success_vs_time.png"][:100])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, fname, *args, **kw)

    b = _write_run(tmp_path / "b", [0.1, 0.3, 0.2])   # another run: every file of its report would differ
    monkeypatch.setattr(Figure, "savefig", savefig)
    capsys.readouterr()
    assert cli_main(["report", str(b), "--out", str(rep)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vla-rl: file error: ") and "No space left on device" in err and str(rep) in err, err
    assert {p.name: p.read_bytes() for p in rep.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "rep"]
    monkeypatch.setattr(Figure, "savefig", real)
    (rep / "notes.txt").write_text("mine")   # a report folder that also holds the user's notes
    assert cli_main(["report", str(a), "--out", str(rep)]) == 2
    assert "notes.txt" in capsys.readouterr().err and (rep / "notes.txt").read_text() == "mine"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert cli_main(["report", str(a), "--out", str(other)]) == 2
    assert "--overwrite" in capsys.readouterr().err and (other / "notes.txt").read_text() == "mine"
