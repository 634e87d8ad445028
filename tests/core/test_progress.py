"""Progress of long work: a tqdm bar on a terminal, a plain line every few seconds in a log (known answers with a
hand-driven clock), and the evaluations of `vla-rl eval` and of a training reporting episodes done / total."""

import io

import pytest
import torch

import vla_rl.core.progress as progress_module
from vla_rl.core.progress import LineProgress, is_terminal, progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_lines_come_every_interval_with_rate_and_time_left():
    out, clock = io.StringIO(), Clock()
    bar = LineProgress(total=10, desc="rl", unit="iterations", file=out, interval=5, clock=clock)
    for _ in range(3):          # 3 iterations in 3 s: under the interval, nothing written
        clock.t += 1
        bar.update(1)
    assert out.getvalue() == ""
    clock.t += 2                # 5 s: a line
    bar.update(1)
    bar.set_postfix(loss="0.12")
    clock.t += 1
    bar.update(1)               # 1 s after the line: none
    bar.close()                 # the final count, since a line was written before
    bar.close()                 # idempotent
    assert out.getvalue().splitlines() == [
        "rl: 4/10 iterations (40%), 1.25 s/iteration, 5s elapsed, ~8s left",
        "rl: 5/10 iterations (50%), 1.2 s/iteration, 6s elapsed, ~6s left, loss=0.12",
    ]


def test_short_work_writes_nothing_and_disabled_never_writes():
    out, clock = io.StringIO(), Clock()
    for _ in LineProgress(range(4), desc="sft", file=out, interval=5, clock=clock):
        clock.t += 1
    assert out.getvalue() == ""
    bar = LineProgress(total=2, file=out, interval=0, enabled=False, clock=clock)
    bar.update(2)
    bar.close()
    assert out.getvalue() == ""


def test_a_resumed_count_sets_the_rate_from_this_process_only():
    out, clock = io.StringIO(), Clock()
    bar = LineProgress(total=100, initial=60, desc="rl", unit="iterations", file=out, interval=0, clock=clock)
    clock.t += 20
    bar.update(10)    # 10 iterations in 20 s here, not 70
    assert out.getvalue() == "rl: 70/100 iterations (70%), 2 s/iteration, 20s elapsed, ~1m00s left\n"
    bar = LineProgress(desc="plans", unit="plans", file=out, interval=0, clock=clock)   # no total
    clock.t += 3700
    bar.update(7400)
    assert out.getvalue().splitlines()[-1] == "plans: 7400 plans, 2 plans/s, 1h01m elapsed"


def test_a_terminal_gets_a_tqdm_bar_anything_else_lines():
    from tqdm import tqdm

    bar = progress(total=3, file=Terminal())
    assert isinstance(bar, tqdm)
    bar.close()
    assert isinstance(progress(total=3, file=io.StringIO()), LineProgress)
    assert isinstance(progress(total=3, file=Terminal(), enabled=False), LineProgress)   # silent
    assert not is_terminal(object()) and is_terminal(Terminal())
    with pytest.raises(ValueError, match="interval"):
        LineProgress(interval=-1)


@pytest.fixture
def every_update(monkeypatch):
    """Progress lines at every update (a log file otherwise gets one every LOG_INTERVAL_S)."""
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 0.0)


def test_eval_reports_episodes_as_they_end(tmp_path, capsys, every_update):
    from vla_rl.checkpoint.policy import save_policy
    from vla_rl.cli import main
    from vla_rl.policies.model import FlowPolicy
    from vla_rl.policies.normalize import NormStats, Stats
    from vla_rl.presets import policy_preset

    ckpt = save_policy(tmp_path / "policy", FlowPolicy(policy_preset("tiny", {"depth": 1})),
                       NormStats(Stats.identity(4), Stats.identity(2)), meta={"env_config": {"kind": "builtin"}})
    assert main(["eval", str(ckpt), "episodes=6", "num_envs=3", "env.builtin.max_episode_steps=12"]) == 0
    err = capsys.readouterr().err.splitlines()
    counts = [int(line.split()[1].split("/")[0]) for line in err if line.startswith("eval: ")]
    assert counts and counts == sorted(counts) and counts[-1] == 6 and all(f"{c}/6" for c in counts)
    assert main(["eval", str(ckpt), "episodes=6", "num_envs=3", "env.builtin.max_episode_steps=12",
                 "progress=false"]) == 0
    assert "eval: " not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- threads
def test_auto_threads_are_the_idle_cores_less_one_per_worker_process():
    from vla_rl.core.threads import auto_threads, policy_threads, torch_threads

    none = {}   # no OMP_NUM_THREADS
    assert policy_threads("auto", worker_processes=0, cores=8, busy=0.0, environ=none) == 8
    assert policy_threads("auto", worker_processes=6, cores=8, busy=0.0, environ=none) == 2
    assert policy_threads("auto", worker_processes=2, cores=2, busy=0.0, environ=none) == 1    # never 0
    assert policy_threads(3, worker_processes=2, cores=2) == 3         # a number is used as given
    assert policy_threads("auto", cores=8, environ={"OMP_NUM_THREADS": "1"}) == 1   # the variable keeps its meaning
    assert policy_threads("auto", cores=8, busy=0.0, environ={"OMP_NUM_THREADS": "x"}) == 8
    # The load: a busy machine gets fewer threads (2 cores, one of them taken: 1, the case that ran 14x slower
    # with 2); background noise below IDLE_SLACK (0.25 core) costs no thread; loads beyond the cores give 1.
    assert [auto_threads(2, busy) for busy in (0.0, 0.2, 0.3, 0.9, 1.0, 1.5, 2.0, 8.0)] == [2, 2, 1, 1, 1, 1, 1, 1]
    assert [auto_threads(16, busy) for busy in (0.1, 3.0, 3.8, 12.0, 15.9, 40.0)] == [16, 13, 12, 4, 1, 1]
    assert auto_threads(16, 3.0, worker_processes=8) == 5     # workers and policy together within the idle cores
    assert auto_threads(16, 12.0, worker_processes=8) == 1
    assert auto_threads(4, -1.0) == 4                          # a negative reading is no load
    assert policy_threads("auto", cores=2, busy=1.0, environ=none) == 1
    assert policy_threads("auto", cores=8, busy=2.0, worker_processes=2, environ=none) == 4
    with pytest.raises(ValueError, match="threads must be 'auto' or an integer >= 1, got 0"):
        policy_threads(0)
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_threads_is_a_range_checked_field_of_the_job_configs():
    from vla_rl.core.ranges import ConfigError
    from vla_rl.core.schema import from_dict
    from vla_rl.eval.bench import BenchConfig
    from vla_rl.eval.evaluate import EvalConfig
    from vla_rl.train.sft import SFTRunConfig
    from vla_rl.train.trainer import TrainConfig

    for cls in (TrainConfig, SFTRunConfig, EvalConfig, BenchConfig):
        assert cls().threads == "auto" and from_dict(cls, {"threads": 2}).threads == 2
        with pytest.raises(ConfigError, match="threads = 0 is outside its valid range"):
            from_dict(cls, {"threads": 0})
        with pytest.raises(ConfigError, match="threads: 'all'"):
            from_dict(cls, {"threads": "all"})


def test_a_trainer_sets_its_threads_and_gives_the_previous_count_back(tmp_path, monkeypatch):
    """The built-in env has no worker processes: ``auto`` is every idle core (all of them on an idle machine, one
    on a machine whose cores are all busy); a number is used; ``close`` restores the count the process had."""
    import vla_rl.core.threads
    from vla_rl.core.schema import from_dict
    from vla_rl.core.threads import available_cores
    from vla_rl.train.trainer import TrainConfig, Trainer

    cfg = {"env": {"num_envs": 2}, "iterations": 0, "eval_episodes": 2, "tensorboard": False, "progress": False,
           "model": "tiny"}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    lines = []
    for busy, expected in ((0.0, available_cores()), (float(available_cores()), 1)):
        monkeypatch.setattr(vla_rl.core.threads, "measured_busy_cores", lambda b=busy: b)
        with Trainer(from_dict(TrainConfig, {**cfg, "out": str(tmp_path / f"a{busy}")}), log=lines.append) as t:
            assert t.threads == expected == torch.get_num_threads()
    if available_cores() > 1:
        assert f"torch threads in this process: 1 (threads=auto: 0 of {available_cores()} cores idle)" in lines
    with Trainer(from_dict(TrainConfig, {**cfg, "out": str(tmp_path / "b"), "threads": 1}), log=lambda *_: None):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_busy_cores_read_from_proc_stat():
    from vla_rl.core.threads import available_cores, busy_cores, cpu_ticks

    stat = ("cpu  30 0 10 50 5 0 0 5 0 0\n"
            "cpu0 10 0 5 20 5 0 0 0 0 0\n"      # busy 15 of 40 (iowait is idle)
            "cpu1 20 0 5 30 0 0 0 5 0 0\n"      # busy 30 of 60 (steal is busy)
            "intr 123 0 0\nctxt 9\n")
    assert cpu_ticks(stat) == (45, 100)
    assert cpu_ticks(stat, {1}) == (30, 60)
    busy = busy_cores(0.05)
    assert 0.0 <= busy <= available_cores() + 0.5   # the sample's own rounding (clock ticks of 10 ms)
