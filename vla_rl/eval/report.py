"""Learning curves and a summary of training runs (``vla-rl report RUN_DIR [RUN_DIR ...]``).

A run folder's ``metrics.jsonl`` holds one line per iteration (plus the evaluation before RL at
iteration 0). This module reads it, takes the evaluation curve (success vs environment steps and vs wall
time) and the training diagnostics, draws them with matplotlib (several runs on one figure, each named),
and summarises each run: final and best evaluation success, and the steps and time to the best and to 90 %.

Wall time is the sum of the iterations' ``time/iteration_s`` up to that line (the evaluation before RL is
not timed), so a resumed run's curve has no gap for the time it was stopped.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from vla_rl.checkpoint.folders import atomic_folder
from vla_rl.checkpoint.metrics_log import read_metrics
from vla_rl.core.errors import CheckpointError
from vla_rl.core.outputs import REPORT, OutputExistsError, check_output, folder_kind
from vla_rl.rl.health import HINTS, SIGNALS, HealthConfig, noise_cost_line, success_trend, trend_statement

SUCCESS = "eval/success_once"
FIGURES = ("success_vs_steps.png", "success_vs_time.png", "diagnostics.png")
REPORT_FILES = ("report.md", *FIGURES)   # all a report folder holds: it is written (and replaced) whole
DIAGNOSTICS = (  # (metric, title) of the diagnostics figure, in panel order
    ("rollout/success_once", "rollout success"),
    ("losses/approx_kl", "approx. KL"),
    ("losses/clipfrac", "clip fraction"),
    ("losses/value", "value loss"),
    ("losses/explained_variance", "explained variance"),
    ("losses/entropy", "entropy"),
)
TARGET = 0.9


class ReportError(ValueError):
    """A run folder that cannot be reported (missing or unreadable metrics)."""


@dataclass
class Run:
    """One run folder's metrics, with the cumulative env steps and wall time of each record."""

    name: str
    records: list[dict]

    @staticmethod
    def load(path: str | Path, name: str | None = None) -> Run:
        """A run folder's ``metrics.jsonl`` (the trainer's reader: a torn last line is dropped, any other
        unreadable line is an error naming it)."""
        path = Path(path)
        if not (path / "metrics.jsonl").is_file():
            raise ReportError(f"no metrics file at {path / 'metrics.jsonl'}")
        try:
            return Run(name or path.name, read_metrics(path / "metrics.jsonl", log=lambda _: None))
        except CheckpointError as e:
            raise ReportError(str(e)) from None

    def series(self, key: str) -> tuple[list[float], list[float], list[float]]:
        """(env steps, wall seconds, value) of every record that has a finite ``key``."""
        steps, secs, vals, wall = [], [], [], 0.0
        for rec in self.records:
            wall += float(rec.get("time/iteration_s", 0.0) or 0.0)
            v = rec.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                steps.append(float(rec.get("time/env_steps", 0)))
                secs.append(wall)
                vals.append(float(v))
        return steps, secs, vals


@dataclass(frozen=True)
class RunSummary:
    """Evaluation success of a run: first, final and best, and where the best and the 90 % mark were reached
    (env steps, wall seconds, iteration; None when never reached)."""

    name: str
    evaluations: int
    first: float | None
    final: float | None
    best: float | None
    best_iteration: int | None
    best_steps: float | None
    best_seconds: float | None
    target_iteration: int | None
    target_steps: float | None
    target_seconds: float | None


def summarize_run(run: Run, target: float = TARGET) -> RunSummary:
    steps, secs, vals = run.series(SUCCESS)
    iters = [int(r["iteration"]) for r in run.records if isinstance(r.get(SUCCESS), (int, float))
             and math.isfinite(r[SUCCESS])]
    if not vals:
        return RunSummary(run.name, 0, None, None, None, None, None, None, None, None, None)
    b = max(range(len(vals)), key=lambda i: (vals[i], -i))   # the first evaluation at the best value
    t = next((i for i, v in enumerate(vals) if v >= target), None)
    pick = lambda xs, i: None if i is None else xs[i]  # noqa: E731
    return RunSummary(run.name, len(vals), vals[0], vals[-1], vals[b], iters[b], steps[b], secs[b],
                      pick(iters, t), pick(steps, t), pick(secs, t))


def _fmt(x, kind: str = "rate") -> str:
    if x is None:
        return "—"
    if kind == "rate":
        return f"{x:.3f}"
    if kind == "steps":
        return f"{x / 1e3:.0f}k" if x < 1e6 else f"{x / 1e6:.2f}M"
    if kind == "time":
        return f"{x / 60:.1f} min"
    return str(x)


def summary_table(summaries: list[RunSummary], target: float = TARGET) -> str:
    """A markdown table of :func:`summarize_run` results."""
    pct = f"{round(100 * target)} %"
    head = (f"| run | evals | first | final | best | best at (iter / steps / time) | {pct} at (iter / steps / time) |\n"
            "|---|---|---|---|---|---|---|\n")
    rows = []
    for s in summaries:
        at_best = f"{_fmt(s.best_iteration, 'int')} / {_fmt(s.best_steps, 'steps')} / {_fmt(s.best_seconds, 'time')}"
        at_t = ("not reached" if s.target_iteration is None else
                f"{s.target_iteration} / {_fmt(s.target_steps, 'steps')} / {_fmt(s.target_seconds, 'time')}")
        rows.append(f"| {s.name} | {s.evaluations} | {_fmt(s.first)} | {_fmt(s.final)} | {_fmt(s.best)} | "
                    f"{at_best} | {at_t} |")
    return head + "\n".join(rows) + "\n"


def _steps_axis(ax) -> None:
    """Env-step ticks as 25k / 1.2M, at most 6 of them: six-digit labels overlapped in a diagnostics panel."""
    from matplotlib.ticker import EngFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))


def _ranges(iterations: list[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``"2-4, 7"``."""
    parts, start = [], None
    for i, it in enumerate(iterations):
        if start is None:
            start = it
        if i + 1 == len(iterations) or iterations[i + 1] != it + 1:
            parts.append(str(start) if start == it else f"{start}-{it}")
            start = None
    return ", ".join(parts)


def health_text(run: Run) -> str:
    """What a run's health metrics say (vla_rl/rl/health.py): the exploration noise's cost before RL, the
    iterations each signal was raised with its hint, and whether success rose over the run (a trend test)."""
    lines = [f"**{run.name}**", ""]
    first = run.records[0] if run.records else {}
    if "explore/success_noisy" in first:
        lines.append("- " + noise_cost_line(first["explore/success_ode"], first["explore/success_noisy"],
                                            episodes=int(first.get("eval/episodes", 0)), sampler_text="rollout",
                                            max_cost=HealthConfig().max_noise_cost))
    for name in SIGNALS:
        its = [int(r["iteration"]) for r in run.records if r.get(f"health/{name}", 0) > 0]
        if its:
            lines.append(f"- {name.replace('_', ' ')}: iterations {_ranges(its)}: {HINTS[name]}")
    if not any(r.get(f"health/{name}", 0) > 0 for r in run.records for name in SIGNALS):
        lines.append("- no health signal was raised" if any("health/collapse" in r for r in run.records)
                     else "- no health metrics in this run")
    points = [(int(r["iteration"]), float(r[SUCCESS])) for r in run.records
              if isinstance(r.get(SUCCESS), (int, float)) and math.isfinite(r[SUCCESS])]
    if points:
        lines.append(f"- {trend_statement(success_trend(points))}")
    return "\n".join(lines) + "\n"


def plot_runs(runs: list[Run], out_dir: str | Path) -> list[Path]:
    """Write ``success_vs_steps.png``, ``success_vs_time.png`` and ``diagnostics.png`` into ``out_dir``;
    returns their paths. Every run is one line, labelled with its name."""
    import matplotlib

    matplotlib.use("Agg")   # files only: no display is needed (or available on a server)
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fname, axis, xlabel in (("success_vs_steps.png", 0, "environment steps"),
                                ("success_vs_time.png", 1, "wall time (min)")):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for run in runs:
            xs = run.series(SUCCESS)[axis]
            ys = run.series(SUCCESS)[2]
            if axis == 1:
                xs = [x / 60 for x in xs]
            ax.plot(xs, ys, marker="o", markersize=3, label=run.name)
        ax.set_xlabel(xlabel)
        if axis == 0:
            _steps_axis(ax)
        ax.set_ylabel("evaluation success")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        _save_figure(fig, out / fname, dpi=120)
        plt.close(fig)
        paths.append(out / fname)
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.4))
    for ax, (key, title) in zip(axes.flat, DIAGNOSTICS):
        shown = False
        for run in runs:
            steps, _, vals = run.series(key)
            if key == "losses/entropy" and not vals:   # runs without an entropy bonus log the noise std
                steps, _, vals = run.series("rollout/entropy")
            if vals:
                ax.plot(steps, vals, label=run.name, linewidth=1)
                shown = True
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("environment steps", fontsize=8)
        ax.grid(alpha=0.3)
        if shown:
            _steps_axis(ax)
        else:
            ax.set_xticks([])
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    _save_figure(fig, out / "diagnostics.png", dpi=110)
    plt.close(fig)
    paths.append(out / "diagnostics.png")
    return paths


def write_report(run_dirs: list[str | Path], out_dir: str | Path, *, names: list[str] | None = None,
                 target: float = TARGET, overwrite: bool = False) -> tuple[Path, str]:
    """Plot ``run_dirs`` and write ``report.md`` (the summary table, each run's health and trend, and the figures)
    into ``out_dir``; returns its path and the text of the table and the health sections. The folder is written
    aside and renamed into place (:func:`~vla_rl.checkpoint.folders.atomic_folder`): a full disk or a kill leaves
    the earlier report whole. ``out_dir`` may hold an earlier report (replaced); files a report does not write
    need ``overwrite``, and another kind of data is refused (:mod:`vla_rl.core.outputs`)."""
    if not run_dirs:
        raise ReportError("give at least one run folder")
    check_output(out_dir, overwrite=overwrite, kind=REPORT, reuse=True, elsewhere="another --out",
                 inputs=[("run folder", d) for d in run_dirs])
    others = sorted(p.name for p in Path(out_dir).iterdir() if p.name not in REPORT_FILES) \
        if folder_kind(out_dir) == REPORT else []
    if others and not overwrite:   # the earlier report is replaced whole: what else is there would go with it
        raise OutputExistsError(f"{out_dir} holds an earlier report and files a report does not write ({others[:4]}"
                                f"{' ...' if len(others) > 4 else ''}): replacing the report would remove them; "
                                "start over with `--overwrite`, or write elsewhere with another --out")
    if names is not None and len(names) != len(run_dirs):
        raise ReportError(f"{len(names)} names for {len(run_dirs)} runs")
    runs = [Run.load(d, None if names is None else names[i]) for i, d in enumerate(run_dirs)]
    dup = sorted({r.name for r in runs if sum(q.name == r.name for q in runs) > 1})
    if dup:
        raise ReportError(f"two runs are both named {dup}: name them with --names")
    table = summary_table([summarize_run(r, target) for r in runs], target)
    health = "## Training health\n\n" + "\n".join(health_text(r) for r in runs)
    with atomic_folder(out_dir) as tmp:
        figures = plot_runs(runs, tmp)
        body = ["# Training report", "", "Runs: " + ", ".join(f"`{r.name}` ({d})" for r, d in zip(runs, run_dirs)),
                "", table, health, *[f"![{p.stem}]({p.name})" for p in figures], ""]
        (tmp / "report.md").write_text("\n".join(body))
    return Path(out_dir) / "report.md", table + "\n" + health


def _replace_atomically(path: Path, write) -> None:
    """``write(tmp)`` into a temporary sibling of ``path``, then rename it into place: a full disk or a kill leaves
    the previous file whole (or none), never a truncated one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _save_figure(fig, path: Path, dpi: int) -> None:
    _replace_atomically(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
