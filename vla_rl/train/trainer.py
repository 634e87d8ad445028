"""The RL runner: the only training loop. It talks to the envs (``reset`` / ``step``), to policy sampling
(:func:`collect_rollout`) and to the learner (:meth:`Learner.update`) through narrow interfaces, so each
can later become a remote actor without touching this loop.

Each iteration resets the envs with a seed derived from (seed, iteration) and collects ``rollout_chunks``
chunks; the rollout noise generator and the minibatch order are seeded the same way. A run's future is
therefore fully determined by (config, weights, optimizer state, iteration), which is what a checkpoint
holds, once simulators that carry state across episodes forget it where a run can resume
(:meth:`Trainer._forget_env_history`): a resumed run on the built-in task or on ManiSkill's CPU workers
reproduces an uninterrupted one exactly.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
import yaml

from vla_rl.checkpoint.folders import read_yaml_file, write_atomic_folder
from vla_rl.checkpoint.metrics_log import MetricsLog, summary_line
from vla_rl.checkpoint.policy import load_any_policy, load_policy, policy_files
from vla_rl.checkpoint.training import (
    list_checkpoints,
    load_training_state,
    resume_candidates,
    save_checkpoint,
    verify_checkpoint,
)
from vla_rl.core.errors import CheckpointError
from vla_rl.core.outputs import RUN, check_output, clear_output
from vla_rl.core.progress import progress
from vla_rl.core.ranges import ConfigError, check_ranges, nonneg, positive, ranged
from vla_rl.core.schema import from_dict, to_dict
from vla_rl.core.threads import policy_threads, threads_note
from vla_rl.distributed.learners import LearnerError
from vla_rl.distributed.ray_config import RayConfig
from vla_rl.distributed.runtime import make_runtime
from vla_rl.envs.registry import EnvConfig, make_env, official_episode_steps
from vla_rl.envs.workers import local_worker_processes
from vla_rl.eval.evaluate import evaluate
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import merge, policy_preset, resolve_device
from vla_rl.rl.algorithms import AlgorithmConfig, make_algorithm, upgrade_ppo_section
from vla_rl.rl.health import (
    HealthConfig,
    HealthMonitor,
    flow_noise_entropy_floor,
    noise_cost,
    noise_cost_line,
    success_trend,
    trend_statement,
)
from vla_rl.rl.learner import Learner, LearnerConfig
from vla_rl.rl.rollout import Rollout, collect_rollout, step_groups
from vla_rl.train.lengths import resolve_lengths
from vla_rl.train.memory_plan import check_plan, device_memory
from vla_rl.train.preflight import image_warnings, recorded_limit, rollout_warnings


class TrainingError(RuntimeError):
    """A run cannot go on (its updates stopped being finite); the message says what the newest checkpoint is."""


@dataclass(frozen=True)
class TrainConfig:
    init: str | None = None              # SFT policy folder (weights + normalisation); None: fresh model
    model: str = "tiny"                  # model preset, used only when init is None
    env: EnvConfig = field(default_factory=EnvConfig)
    sampler: SamplerConfig = field(default_factory=lambda: SamplerConfig(num_steps=4, method="noise"))
    # The RL method (vla_rl/rl/algorithms/: ppo, grpo, rloo, dapo, fpo) and its own section; the learner's settings
    # (epochs, minibatches, learning rates, precision, LoRA) are every method's.
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    # T chunk steps per env per iteration; "auto": one episode's worth, ceil(episode limit / execute)
    rollout_chunks: int | Literal["auto"] = ranged(4, 1)
    # "env": the env section's max_episode_steps (or the task's official limit); "demos": the init policy's longest
    # SFT demo x 1.25 in whole chunks, at most the official limit, so a recipe moved to another task takes that
    # task's length (vla_rl/train/lengths.py)
    episode_limit: Literal["env", "demos"] = "env"
    # Worker envs (ManiSkill / LIBERO on CPU, Ray env actors): split the envs into this many groups of whole
    # workers, stepped in alternation, so the policy samples one group's next chunk while the others simulate
    # (the rollout is the one of 1 group up to float rounding: see collect_rollout). 1: one batch, in lockstep.
    rollout_groups: int = ranged(1, 1)
    execute: int = ranged(8, 1)          # E actions executed of each H-action chunk
    iterations: int = nonneg(20)
    # A wall-time budget for this invocation (None: none): once the next iteration would end past it, the run
    # evaluates, saves a checkpoint and returns normally; `vla-rl train --resume` continues it (with a new budget).
    max_minutes: float | None = positive(None)
    # The run's length in env-steps (None: `iterations` alone): it ends, evaluated and saved, after the iteration
    # that reaches this many, so methods that collect different amounts per iteration (DAPO's top-ups) compare at
    # equal env-steps.
    max_env_steps: int | None = positive(None)
    eval_every: int = ranged(5, 1)
    eval_episodes: int = ranged(100, 1)
    eval_seed: int = nonneg(10_000)
    # "ode": the deterministic sampler a deployed policy uses. "train": the rollout sampler (sampler.method,
    # its noise level and sde_mode), i.e. the stochastic policy PPO optimises; RL can lift that one first.
    eval_method: Literal["ode", "train"] = "ode"
    keep_best: bool = True               # also keep checkpoints/best: the policy of the best evaluation so far
    seed: int = nonneg(0)
    device: str = "cpu"
    bf16: bool = False
    out: str = "runs/train"
    save_every: int = ranged(5, 1)
    keep_last: int = ranged(2, 1)        # newest resume checkpoints kept (checkpoints/best is extra)
    # Stop the run (an error, exit 2 from the CLI) when this many iterations in a row had every update step
    # skipped as non-finite: the weights no longer change, so the run would only burn time.
    max_skipped_iterations: int = ranged(3, 1)
    tensorboard: bool = True
    progress: bool = True
    # torch threads of this process: "auto" = the cores idle at the start less one per env worker process (at
    # least 1), or a number (1 when several jobs start together on one machine); see vla_rl.core.threads
    threads: int | Literal["auto"] = ranged("auto", 1)
    # "ray": env actors and learners on a Ray cluster as the `ray` section says (pip install 'vla-rl[ray]');
    # the same loop, and (env_actors 0) the same numbers as "local".
    runtime: Literal["local", "ray"] = "local"
    ray: RayConfig = field(default_factory=RayConfig)
    # On CUDA (local runtime) the run first plans its memory per GPU (vla_rl/train/memory_plan.py) and stops before
    # starting anything if it cannot fit, naming settings that would; false skips the check.
    memory_plan: bool = True
    # Training-health signals (no signal, collapse, value blind) and the exploration noise's cost before RL
    # (vla_rl/rl/health.py, docs/training.md#training-health).
    health: HealthConfig = field(default_factory=HealthConfig)

    def __post_init__(self):
        check_ranges(self)
        if self.eval_method not in ("ode", "train"):
            raise ConfigError(f"eval_method must be 'ode' or 'train', got {self.eval_method!r}")
        if self.episode_limit not in ("env", "demos"):
            raise ConfigError(f"episode_limit: {self.episode_limit!r} is not one of ['env', 'demos']")
        if self.runtime not in ("local", "ray"):
            raise ConfigError(f"runtime: {self.runtime!r} is not one of ['local', 'ray']")
        if self.runtime == "local" and self.ray != RayConfig():
            raise ConfigError("ray is set but runtime is 'local': set runtime=ray or drop the ray section")
        if self.runtime == "ray" and self.ray.sharding == "fsdp" and "bf16" in (self.learner.param_dtype,
                                                                              self.learner.optimizer_state_dtype):
            # the lean optimizer's stochastic rounding works on whole tensors, not on FSDP's shards (untested there)
            raise ConfigError("ray.sharding=fsdp goes with learner.param_dtype=fp32 and "
                              "learner.optimizer_state_dtype=fp32 (sharding already divides the optimizer state by "
                              "the learners)")
        if self.runtime == "ray" and self.ray.env_actors:
            if self.ray.env_actors > self.env.num_envs:
                raise ConfigError(f"ray.env_actors = {self.ray.env_actors} is more than env.num_envs = "
                                  f"{self.env.num_envs}: an env actor needs at least one env")
            if self.env.envs_per_worker is not None:
                raise ConfigError("env.envs_per_worker groups envs into local worker processes; with "
                                  "ray.env_actors the envs are split evenly over the actors (drop one of the two)")
        make_algorithm(self.algorithm).check_sampler(self.sampler)

    @staticmethod
    def upgrade(data: dict) -> dict:
        """Read a config written before the algorithm sections (:func:`~vla_rl.rl.algorithms.upgrade_ppo_section`):
        run folders of that format resume, old presets and overrides keep working."""
        return upgrade_ppo_section(data)


ROLLOUT_SEED_BASE = 1_000_000
TOPUPS_PER_ITERATION = 64   # at most this many additional rollouts an iteration (an algorithm's max_rollouts)


def eval_env_for(cfg: TrainConfig, train_env, device: torch.device, log=print):
    """The env evaluations run on: the training env itself when ``eval_episodes >= num_envs``, else a
    separate env of ``eval_episodes`` envs.

    Why share: a second env of the same size would be identical, and with worker envs it doubles the
    processes (ManiSkill on CPU: ~0.55 GB per extra worker). Sharing changes no result: evaluate()
    resets with explicit seeds, and every training iteration resets the env with its own seed before
    collecting. Only a batch larger than the evaluation (e.g. 320 GPU envs for 100 episodes) gets its own,
    smaller env, so evaluations are not padded with unused envs."""
    if cfg.eval_episodes >= train_env.num_envs:
        return train_env
    return make_env(cfg.env, num_envs=cfg.eval_episodes, device=device, seed=cfg.seed + 1, log=log)


def rollout_seed(seed: int, iteration: int, num_envs: int) -> int:
    """The reset seed of an iteration's rollout. Worker envs (ManiSkill, LIBERO) give env ``i`` the seed
    ``rollout_seed + i``, so iterations take disjoint blocks of ``num_envs`` seeds, all at or above
    ROLLOUT_SEED_BASE: away from the demo collection seeds (0, 1, ...) and the evaluation seeds (10_000, ...).

    Why: a seed that grows by 1 per iteration (``seed * 1_000_003 + iteration``) would make iteration ``it`` use
    seeds ``it .. it + 15`` on 16 ManiSkill workers, so 100 iterations would see only 115 distinct initial
    states, and those the motion-planner demos' own seeds, where the SFT policy already succeeds (measured on
    PickCube: Flow-SDE rollouts succeeded on 70-96 % of the envs while the held-out evaluation read 27 %)."""
    return ROLLOUT_SEED_BASE * (seed + 1) + iteration * num_envs


def topup_seed(seed: int, iteration: int, extra: int, num_envs: int) -> int:
    """The reset seed of iteration ``iteration``'s ``extra``-th additional rollout (dynamic sampling): blocks of
    ``num_envs`` seeds half-way up the run's range, away from every iteration's first rollout (those stay below
    it for the first ROLLOUT_SEED_BASE / 2 / num_envs iterations) and from each other (up to
    TOPUPS_PER_ITERATION)."""
    block = iteration * TOPUPS_PER_ITERATION + extra
    return ROLLOUT_SEED_BASE * (seed + 1) + ROLLOUT_SEED_BASE // 2 + block * num_envs


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Trainer:
    """One RL run in ``run_dir`` (default ``cfg.out``).

    A fresh run refuses a ``run_dir`` that already holds something (:class:`~vla_rl.core.outputs.OutputExistsError`)
    unless ``overwrite``, in which case the old contents are removed when :meth:`run` starts. ``resume_from``
    (what :func:`resume_trainer` passes) is a training checkpoint: the policy is rebuilt from it alone (not from
    ``cfg.init``) and the optimizer, RNG and iteration are restored."""

    def __init__(self, cfg: TrainConfig, *, run_dir: str | Path | None = None, log=print, overwrite: bool = False,
                 resume_from: str | Path | None = None):
        self.algorithm = make_algorithm(cfg.algorithm)
        self.algorithm.check_sampler(cfg.sampler)
        cfg, notes = resolve_lengths(cfg)   # a resumed run's saved config holds the numbers already
        for note in notes:
            log(note)
        self.cfg, self.log = cfg, log
        self.run_dir = Path(run_dir or cfg.out)
        self.resume_from = Path(resume_from) if resume_from is not None else None
        self._clear_on_run = False
        if self.resume_from is None:
            check_output(self.run_dir, overwrite=overwrite, kind=RUN, resumable=True,
                         inputs={"init policy": cfg.init})
            self._clear_on_run = overwrite
        self.device = resolve_device(cfg.device)
        self.metrics = MetricsLog(self.run_dir, tensorboard=cfg.tensorboard, log=log)
        self.env = self.eval_env = self.runtime = self.learner = None
        self._threads_before: int | None = None   # torch's thread count before this trainer set its own
        try:
            self._build(cfg)
        except BaseException:
            # A bad init checkpoint or config must not leave the envs' worker processes running.
            self.close()
            raise

    def _build(self, cfg: TrainConfig) -> None:
        if cfg.memory_plan and self.device.type == "cuda" and cfg.runtime == "local":
            free, name = device_memory(self.device)
            check_plan(cfg, device_bytes=free, device_name=name, log=self.log)
        self.runtime = make_runtime(cfg.runtime, cfg.ray, log=self.log)
        if self.runtime.remote_envs:
            self.env = self.runtime.make_env(cfg.env, num_envs=cfg.env.num_envs, device=self.device, seed=cfg.seed,
                                             log=self.log)
            # Env actors evaluate too: worker envs give env i the seed `seed + i` whatever their number, so the
            # first `eval_episodes` envs play the episodes a smaller env would, and no more actors are reserved.
            self.eval_env = self.env
        else:
            self.env = make_env(cfg.env, num_envs=cfg.env.num_envs, device=self.device, seed=cfg.seed, log=self.log)
            self.eval_env = eval_env_for(cfg, self.env, self.device, log=self.log)
        workers = local_worker_processes([self.env, self.eval_env])
        self.threads = policy_threads(cfg.threads, worker_processes=workers)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        self.log(f"torch threads in this process: {threads_note(cfg.threads, self.threads, worker_processes=workers)}")
        spec = self.env.spec
        if cfg.rollout_groups > 1:
            try:
                step_groups(self.env, cfg.rollout_groups)
            except ValueError as e:
                raise ConfigError(f"rollout_groups = {cfg.rollout_groups}: {e}") from None
        if self.resume_from is not None:   # self-contained: the checkpoint's own policy config and weights
            model, norm, _ = load_policy(self.resume_from, device=self.device)
        elif cfg.init:
            model, norm, init_config = load_any_policy(cfg.init, device=self.device)
        else:   # a fresh model's weights come from the run's seed: two runs of one config are the same run
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)
                model = make_policy(policy_preset(cfg.model)).to(self.device)
            norm = NormStats(Stats.identity(spec.state_dim), Stats.identity(spec.action_dim))
        if self.resume_from is None:   # a resumed run was warned when it started
            kind = cfg.env.kind
            init_env = init_config.get("env_config") if cfg.init else None
            task_key = cfg.env.info.task_key
            dataset_limit = recorded_limit(init_env, kind, getattr(cfg.env.task, task_key) if task_key else None)
            for warning in rollout_warnings(rollout_chunks=cfg.rollout_chunks, execute=cfg.execute,
                                            episode_limit=spec.max_episode_steps, dataset_limit=dataset_limit,
                                            limit_key=f"env.{kind}.max_episode_steps"):
                self.log(f"warning: {warning}")
            for warning in image_warnings(init_env, kind, to_dict(getattr(cfg.env, kind))):
                self.log(f"warning: {warning}")
        if cfg.execute > model.cfg.action_horizon:
            raise ConfigError(f"execute={cfg.execute} exceeds the policy's action_horizon "
                              f"{model.cfg.action_horizon}")
        self.actor = Actor.for_env(model, norm, spec)
        self.learner = Learner(self.actor, cfg.learner, self.algorithm, bf16=cfg.bf16,
                               total_iterations=cfg.iterations)
        self.iteration = 0
        self.history: list[dict] = []
        self.skipped_in_a_row = 0
        self.stopped_by_budget = False   # the last run() ended at max_minutes, before cfg.iterations
        if self.resume_from is not None:
            self.load(self.resume_from)
        # Learner actors start from this learner's weights and optimizer state (a resumed one's included).
        self.learner = self.runtime.learner(self.learner)

    def close(self) -> None:
        """Release the envs (worker processes, simulators), the learner actors and Ray placement groups (a Ray
        instance the run started is shut down), and the TensorBoard writer. Idempotent.

        Why it matters: a ManiSkill or LIBERO env holds worker processes; a program that runs several
        trainers one after another (``benchmarks/bench_learning.py``) otherwise keeps every earlier
        trainer's workers alive until it exits."""
        if self.eval_env is not None and self.eval_env is not self.env:
            self.eval_env.close()
        if self.env is not None:
            self.env.close()
        self.env = self.eval_env = None
        if self.learner is not None and hasattr(self.learner, "close"):   # learner actors
            self.learner.close()
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
        if self._threads_before is not None:   # the process's thread count as it was before this trainer
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        self.metrics.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------
    # Checkpoints (the files and their checks live in vla_rl.checkpoint.training)
    # ------------------------------------------------------------------------------------------------
    def _policy_folder(self) -> tuple[dict, dict]:
        """The files of a policy folder for the current weights, plus this run's ``train_config.yaml`` (which
        tells ``vla-rl eval`` the env to build)."""
        spec = self.env.spec
        tensors, yamls = policy_files(self.actor.model, self.actor.norm,
                                      {"env": {"kind": self.cfg.env.kind, "state_dim": spec.state_dim,
                                               "action_dim": spec.action_dim}})
        yamls["train_config"] = to_dict(self.cfg)
        return tensors, yamls

    def save(self) -> Path:
        """Resume checkpoint: policy folder contents + optimizer + RNG + iteration (atomic)."""
        return save_checkpoint(self.run_dir, self.iteration, policy=self._policy_folder(),
                               optimizer=self.learner.optimizer, skipped_steps=self.learner.skipped_steps,
                               keep_last=self.cfg.keep_last)

    def load(self, path: Path) -> None:
        """Restore weights, optimizer, RNG and iteration from a resume checkpoint."""
        state = load_training_state(path, model=self.actor.model, optimizer=self.learner.optimizer,
                                    device=self.device)
        self.iteration = state["iteration"]
        self.learner.skipped_steps = state["skipped_steps"]

    def _newest_checkpoint_text(self) -> str:
        ckpts = list_checkpoints(self.run_dir)
        return f"the newest checkpoint is {ckpts[-1]}" if ckpts else "no checkpoint was saved"

    def _update_problem(self, m: dict) -> str | None:
        """Why the run cannot go on after this iteration's update, or None: weights that became NaN / inf, or
        ``max_skipped_iterations`` iterations in a row whose every update step was skipped as non-finite."""
        bad = [n for n, p in self.actor.model.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:
            return (f"the update of iteration {self.iteration} made the weights non-finite "
                    f"({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}); nothing of it was saved and "
                    f"{self._newest_checkpoint_text()}. Lower learner.lr_actor / learner.lr_critic.")
        all_skipped = m.get("train/samples", 0) > 0 and self.learner.applied_steps == 0
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if all_skipped else 0
        if self.skipped_in_a_row >= self.cfg.max_skipped_iterations:
            first = self.iteration - self.skipped_in_a_row + 1
            return (f"iterations {first}-{self.iteration}: every update step had a non-finite loss or gradient "
                    f"and was skipped ({self.skipped_in_a_row} iterations in a row, max_skipped_iterations="
                    f"{self.cfg.max_skipped_iterations}); the weights have not changed since iteration {first - 1} "
                    f"and {self._newest_checkpoint_text()}. Check the rewards; lower learner.lr_actor / "
                    "learner.lr_critic.")
        return None

    # ------------------------------------------------------------------------------------------------
    # Logging
    # ------------------------------------------------------------------------------------------------
    def _record(self, metrics: dict) -> None:
        self.history.append(metrics)
        self.metrics.record(metrics)

    def evaluate(self, method: str | None = None) -> dict[str, float]:
        """Evaluate on the evaluation episodes with ``eval_method``'s sampler, or ``method`` (``ode`` or
        ``train``: the rollout sampler)."""
        method = method or self.cfg.eval_method
        sampler = self.cfg.sampler if method == "train" else replace(self.cfg.sampler, method="ode")
        return evaluate(self.actor, self.eval_env, num_episodes=self.cfg.eval_episodes, sampler=sampler,
                        execute=self.cfg.execute, seed=self.cfg.eval_seed, progress=self.cfg.progress)

    def _exploration_cost(self, m: dict) -> dict[str, float]:
        """The rollout sampler's success against the ODE sampler's on the same evaluation episodes (each
        episode's initial state and initial noise are fixed by its seed), logged with the rule's hint."""
        cfg = self.cfg
        other = self.evaluate("ode" if cfg.eval_method == "train" else "train")["eval/success_once"]
        ode, noisy = (m["eval/success_once"], other) if cfg.eval_method == "ode" else (other, m["eval/success_once"])
        s = cfg.sampler
        pcfg = self.actor.model.cfg
        text = (f"Flow-SDE {s.sde_mode}, noise level {s.noise_level:g}" if s.method == "sde" else
                f"Flow-Noise, std in [{pcfg.noise_std_min:g}, {pcfg.noise_std_max:g}]")
        self.log(noise_cost_line(ode, noisy, episodes=cfg.eval_episodes, sampler_text=text,
                                 max_cost=cfg.health.max_noise_cost))
        return {"explore/success_ode": ode, "explore/success_noisy": noisy,
                "explore/noise_cost": noise_cost(ode, noisy)}

    def _trend_metrics(self, m: dict) -> dict[str, float]:
        """The Mann-Kendall trend of the evaluations so far (this iteration's included)."""
        points = [(h["iteration"], h["eval/success_once"]) for h in [*self.history, m] if "eval/success_once" in h]
        trend = success_trend(points)
        return {} if trend.p is None else {"eval/trend_tau": trend.tau, "eval/trend_p": trend.p}

    def _evaluate_and_keep_best(self) -> dict[str, float]:
        """Evaluate; when ``keep_best`` and the success beats every earlier evaluation of this run (resumed
        history included), save the policy to ``checkpoints/best`` (a policy folder: ``vla-rl eval`` and
        ``init=`` read it) with ``best.yaml`` saying which iteration it is. A resume drops the metrics after its
        checkpoint, so a best saved from those dropped iterations is replaced by the first that beats the kept
        history.

        Why: RL curves on few seeds are noisy and the last checkpoint is often not the best (PickCube
        Flow-Noise: 0.83 at iteration 120, 0.77 at 150), and ``keep_last`` deletes the older ones. The pick is
        made on the evaluation seeds, so it is optimistic; re-evaluate it on other seeds (``vla-rl eval
        CKPT seed=...``) before quoting it."""
        m = self.evaluate()
        if not self.cfg.keep_best:
            return m
        earlier = [h["eval/success_once"] for h in self.history if "eval/success_once" in h]
        if earlier and m["eval/success_once"] <= max(earlier):
            return m
        tensors, yamls = self._policy_folder()
        yamls["best"] = {"iteration": self.iteration, "eval_method": self.cfg.eval_method,
                         "eval_episodes": self.cfg.eval_episodes, "eval_seed": self.cfg.eval_seed,
                         **{k: float(v) for k, v in m.items()}}
        write_atomic_folder(self.run_dir / "checkpoints" / "best", tensors=tensors, yamls=yamls)
        return m

    def _start_run_dir(self) -> None:
        """A fresh run with ``overwrite`` removes the old contents now (not at construction: a run that failed
        to build loses nothing); every run (re)writes ``config.yaml`` atomically."""
        if self._clear_on_run:
            clear_output(self.run_dir)
            self._clear_on_run = False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / ".config.yaml.tmp"
        with open(tmp, "w") as f:
            yaml.safe_dump(to_dict(self.cfg), f, sort_keys=False)
        os.replace(tmp, self.run_dir / "config.yaml")

    # ------------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        if self.env is None:
            raise RuntimeError("this trainer was closed (its envs are gone); make a new one or resume_trainer()")
        try:
            return self._run()
        except LearnerError as e:   # learner actors out of step: stop, leaving the checkpoints as they are
            raise TrainingError(f"{e}. The run stopped after iteration {self.iteration}; "
                                f"{self._newest_checkpoint_text()} (continue it with `vla-rl train --resume "
                                f"{self.run_dir}`)") from None

    def _forget_env_history(self) -> None:
        """Every iteration that starts at a checkpoint (this invocation's first, and each after a save) first has
        the envs forget their history (``forget_history``: ManiSkill's CPU workers rebuild their PhysX scenes),
        so a run resumed there, whose envs are new, steps exactly as the run that went on."""
        for env in {id(e): e for e in (self.env, self.eval_env)}.values():
            if hasattr(env, "forget_history"):
                env.forget_history()

    def _over_budget(self, started: float, iteration_start: float) -> bool:
        """Whether another iteration, as long as the one that started at ``iteration_start``, would end past
        ``max_minutes`` counted from ``started`` (both ``time.perf_counter()``)."""
        if self.cfg.max_minutes is None or self.iteration >= self.cfg.iterations:
            return False
        now = time.perf_counter()
        return (now - started) + (now - iteration_start) > 60 * self.cfg.max_minutes

    def _run(self) -> list[dict]:
        cfg = self.cfg
        started = time.perf_counter()
        self.stopped_by_budget = False
        self._start_run_dir()
        if self.iteration == 0 and not self.history:
            m = {"iteration": 0, "time/env_steps": 0, **self._evaluate_and_keep_best()}
            how = "ODE" if cfg.eval_method == "ode" else f"{cfg.sampler.method} sampler"
            self.log(f"before RL: eval success {m['eval/success_once']:.3f} ({how}, {cfg.eval_episodes} episodes)")
            if cfg.health.measure_noise_cost:
                m.update(self._exploration_cost(m))
            self._record(m)
        entropy_min = (flow_noise_entropy_floor(self.actor.model.cfg.noise_std_min)
                       if cfg.sampler.method == "noise" else None)
        self.health = HealthMonitor(cfg.health, entropy_min=entropy_min, episode_cap=self.env.spec.max_episode_steps,
                                    official_steps=official_episode_steps(cfg.env))
        self.health.replay(self.history)
        bar = progress(total=cfg.iterations, initial=self.iteration, desc="rl", unit="iterations",
                       enabled=cfg.progress)
        try:
            self._iterate(bar, started)
        finally:
            bar.close()
        self._log_summary()
        return self.history

    def _log_summary(self) -> None:
        """The run's summary in the log: did success rise (a trend test), and which health signals were raised."""
        points = [(h["iteration"], h["eval/success_once"]) for h in self.history if "eval/success_once" in h]
        if points:
            self.log(f"summary: {trend_statement(success_trend(points))}")
        flagged = {name: sum(h.get(f"health/{name}", 0) > 0 for h in self.history) for name in self.health.raised}
        raised = [f"{name.replace('_', ' ')} in {k} iterations" for name, k in flagged.items() if k]
        self.log("summary: health signals raised: " + ", ".join(raised) if raised
                 else "summary: no health signal was raised")

    def _rollout(self, seed: int):
        """One rollout from a reset with ``seed`` (the envs in the algorithm's groups sharing an initial state)."""
        cfg, group = self.cfg, self.algorithm.group_size
        obs = self.env.reset(seed=seed, group_size=group) if group > 1 else self.env.reset(seed=seed)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        ro, _ = collect_rollout(self.actor, self.env, obs, num_chunks=cfg.rollout_chunks, sampler=cfg.sampler,
                                execute=cfg.execute, generator=gen, groups=cfg.rollout_groups, group_size=group,
                                algorithm=self.algorithm)
        return ro

    def _collect(self, it: int):
        """Iteration ``it``'s rollout. An algorithm that keeps only some envs' samples (dynamic sampling) gets its
        batch topped up from further rollouts on fresh seeds (:func:`topup_seed`), up to its ``max_rollouts``, until
        it holds as many envs as one rollout."""
        n = self.env.num_envs
        ro = self._rollout(rollout_seed(self.cfg.seed, it, n))
        keep = self.algorithm.keep_envs(ro)
        if keep is None:
            return ro
        parts, kept, env_steps, episodes = [ro.take_envs(keep)], int(keep.sum()), ro.env_steps, [ro]
        for j in range(1, self.algorithm.max_rollouts):
            if kept >= n:
                break
            more = self._rollout(topup_seed(self.cfg.seed, it, j, n))
            keep = self.algorithm.keep_envs(more)
            parts.append(more.take_envs(keep))
            kept += int(keep.sum())
            env_steps += more.env_steps
            episodes.append(more)
        if kept == 0:   # nothing informative anywhere: the first rollout, whose samples the algorithm masks out
            return ro
        return Rollout.join(parts, limit=n, env_steps=env_steps, episodes_of=episodes)

    def _iterate(self, bar, started: float) -> None:
        cfg = self.cfg
        env_steps = sum(int(h.get("time/env_steps_iter", 0)) for h in self.history)
        at_checkpoint = True   # this invocation starts at iteration 0 or at the checkpoint it resumed from
        for it in range(self.iteration, cfg.iterations):
            if cfg.max_env_steps is not None and env_steps >= cfg.max_env_steps:
                return   # a resumed run that had already reached its length
            t0 = time.perf_counter()
            if at_checkpoint:
                self._forget_env_history()
                at_checkpoint = False
            ro = self._collect(it)
            t_roll = time.perf_counter() - t0
            metrics = self.learner.update(ro, iteration=it)
            self.iteration = it + 1
            env_steps += ro.env_steps
            m = {"iteration": self.iteration, "time/env_steps": env_steps, "time/env_steps_iter": ro.env_steps,
                 **ro.metrics(), **metrics}
            for line in self.health.update(m):
                self.log(line)
            problem = self._update_problem(m)
            if problem:   # the iteration's metrics are kept for the diagnosis; nothing of it is saved
                self._record(m)
                raise TrainingError(problem)
            # Out of time: this iteration is the last of the invocation, so it is evaluated and saved.
            last = self._over_budget(started, t0)
            ended = cfg.max_env_steps is not None and env_steps >= cfg.max_env_steps and self.iteration < cfg.iterations
            if self.iteration % cfg.eval_every == 0 or self.iteration == cfg.iterations or last or ended:
                m.update(self._evaluate_and_keep_best())
                m.update(self._trend_metrics(m))
            dt = time.perf_counter() - t0
            m["time/env_steps_per_s"] = ro.env_steps / t_roll
            m["time/iteration_s"] = dt
            m["time/peak_memory_mb"] = _peak_memory_mb(self.device)
            self._record(m)
            self.log(summary_line(m))
            if self.iteration % cfg.save_every == 0 or self.iteration == cfg.iterations or last or ended:
                self.save()
                at_checkpoint = True
            bar.update(1)
            if ended:
                self.log(f"max_env_steps={cfg.max_env_steps} reached after iteration {self.iteration} "
                         f"({env_steps} env-steps): the run is complete")
                return
            if last:
                self.stopped_by_budget = True
                self.log(f"time budget max_minutes={cfg.max_minutes:g} reached: stopped after iteration "
                         f"{self.iteration} of {cfg.iterations} (evaluated and saved); continue with "
                         f"`vla-rl train --resume {self.run_dir}`")
                return


# What a resumed run takes from its checkpoint, not from its config: overriding these could not change anything.
FIXED_ON_RESUME = {"init": "the policy comes from the checkpoint's own weights, not from init",
                   "model": "the policy's architecture is the checkpoint's",
                   "out": "a resumed run goes on in its own folder"}


def resumed_config(saved: dict, overrides: dict, run_dir: str | Path | None = None) -> dict:
    """The config a resumed run continues with: ``saved`` with ``overrides`` merged in. ``runtime=local``
    without a ``ray`` override also drops the saved ``ray`` section, so a run trained on Ray continues on one
    machine (the checkpoints are the same either way).

    Overrides of :data:`FIXED_ON_RESUME` keys (``init``, ``model``, ``out``) that differ from the saved values are
    refused (:class:`ConfigError`): they would do nothing, yet be recorded in the run's config.yaml as if they had.
    ``out`` naming ``run_dir`` itself is accepted. So are other LoRA settings (``learner.lora``): the checkpoints
    hold the run's own adapters."""
    for key, why in FIXED_ON_RESUME.items():
        if key not in overrides or overrides[key] == saved.get(key):
            continue
        if key == "out" and run_dir is not None and overrides[key] is not None and \
                Path(overrides[key]).resolve() == Path(run_dir).resolve():
            continue
        raise ConfigError(f"{key}={overrides[key]} cannot apply to a resumed run ({why}; it started with "
                          f"{key}={saved.get(key)}); drop it, or start a new run with it")
    if overrides.get("runtime") == "local" and "ray" not in overrides:
        saved = {k: v for k, v in saved.items() if k != "ray"}
    merged = merge(saved, overrides)
    # The checkpoints hold the adapters the run trains (their rank, targets and parts): other LoRA settings could not
    # load them, and every checkpoint would look damaged.
    before, after = (from_dict(TrainConfig, cfg).learner.lora for cfg in (saved, merged))
    if before != after:
        raise ConfigError(f"learner.lora cannot change on a resumed run: its checkpoints hold the adapters of "
                          f"{to_dict(before)}; drop the override (asked for {to_dict(after)}), or start a new run")
    return merged


def resume_trainer(run_dir: str | Path, *, overrides: dict | None = None, log=print) -> Trainer:
    """A trainer that continues ``run_dir`` from its newest intact checkpoint (``overrides`` may e.g. raise
    ``iterations``). Metrics logged after that checkpoint are dropped and recomputed.

    The run folder is all it needs: the policy comes from the checkpoint itself, so it resumes from any
    directory and without the ``init`` folder it started from. Leftovers of an interrupted save are tidied;
    a newest checkpoint that is unreadable is reported and the one before it is used."""
    run_dir = Path(run_dir)
    problems = []
    for ckpt in resume_candidates(run_dir, log=log):
        try:
            verify_checkpoint(ckpt)
            saved = read_yaml_file(ckpt / "train_config.yaml")
            cfg = from_dict(TrainConfig, resumed_config(saved, overrides or {}, run_dir))
            if "out" in (overrides or {}):   # the run's own folder (checked above), recorded as it was
                cfg = replace(cfg, out=saved.get("out", cfg.out))
            trainer = Trainer(cfg, run_dir=run_dir, log=log, resume_from=ckpt)
        except CheckpointError as e:
            problems.append(f"{ckpt.name}: {e}")
            log(f"checkpoint {ckpt} is unusable ({e}); trying the one before it")
            continue
        if problems:
            log(f"resuming from {ckpt}, the newest intact checkpoint")
        try:
            trainer.history = trainer.metrics.truncate(trainer.iteration)
        except BaseException:
            trainer.close()
            raise
        return trainer
    raise CheckpointError(f"no intact checkpoint under {run_dir / 'checkpoints'} to resume from: "
                          + "; ".join(problems))
