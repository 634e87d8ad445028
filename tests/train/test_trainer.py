"""The RL runner end to end on the built-in task: a couple of iterations, save, resume, identical
numbers; checkpoint errors; config errors."""

import json

import pytest
import torch
import yaml
from helpers import SMALL, train_config

from vla_rl.cli import main as cli_main
from vla_rl.core.errors import CheckpointError
from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import to_dict
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import policy_preset
from vla_rl.train.trainer import Trainer, resume_trainer


def strip_time(history):
    return [{k: v for k, v in h.items() if not k.startswith("time/") or k == "time/env_steps"} for h in history]


@pytest.mark.parametrize("method", ["noise", "sde"])
def test_resumed_run_reproduces_the_uninterrupted_run(sft_checkpoint, tmp_path, method):
    sampler = {"num_steps": 3, "method": method}
    full = Trainer(train_config(sft_checkpoint, tmp_path / "full", sampler=sampler), log=lambda *_: None).run()
    part = Trainer(train_config(sft_checkpoint, tmp_path / "part", sampler=sampler, iterations=1),
                   log=lambda *_: None)
    part.run()
    resumed = resume_trainer(tmp_path / "part", overrides={"iterations": 2}, log=lambda *_: None)
    assert resumed.iteration == 1
    history = resumed.run()
    assert strip_time(history) == strip_time(full)
    # Sane PPO statistics: the first update starts at ratio 1, and the log-prob aggregation (mean over
    # steps, executed actions only) keeps approx-KL small rather than in the thousands.
    for h in full[1:]:
        assert 0 <= h["losses/approx_kl"] < 1.0 and 0 <= h["losses/clipfrac"] <= 1.0
        assert h["train/skipped_steps"] == 0
    lines = (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [0, 1, 2]
    ckpts = sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir())
    assert ckpts == ["best", "iter_000001", "iter_000002"]   # best: see test_best_checkpoint_...
    assert (tmp_path / "full" / "config.yaml").is_file()


def test_time_budget_stops_cleanly_with_an_evaluation_and_a_checkpoint(sft_checkpoint, tmp_path, capsys,
                                                                       monkeypatch):
    """``max_minutes``: the run stops after the first iteration that leaves no time for another, with that
    iteration evaluated (off the eval_every schedule) and saved, exit status 0; the resumed run finishes with the
    numbers of an uninterrupted one (the extra evaluation changes no training state). Progress in a log: the
    opening evaluation's episodes and the iterations."""
    import vla_rl.core.progress

    monkeypatch.setattr(vla_rl.core.progress, "LOG_INTERVAL_S", 0.0)   # a line at every update
    out, full = tmp_path / "budget", tmp_path / "full"
    over = {"eval_every": 5, "save_every": 5, "learner": {"update_epochs": 1, "minibatches": 2}}
    yaml.safe_dump(to_dict(train_config(sft_checkpoint, out, **over)), (tmp_path / "run.yaml").open("w"))
    assert cli_main(["train", str(tmp_path / "run.yaml"), "max_minutes=1e-6", "progress=true"]) == 0
    printed = capsys.readouterr()
    assert "time budget max_minutes=1e-06 reached: stopped after iteration 1 of 2" in printed.out
    assert "eval: 8/8 episodes (100%)" in printed.err and "rl: 1/2 iterations (50%)" in printed.err
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1] and "eval/success_once" in lines[1]
    assert (out / "checkpoints" / "iter_000001").is_dir()
    resumed = resume_trainer(out, overrides={"max_minutes": None}, log=lambda *_: None).run()
    uninterrupted = Trainer(train_config(sft_checkpoint, full, **over), log=lambda *_: None).run()
    assert [x["iteration"] for x in resumed] == [0, 1, 2]
    no_eval = [[{k: v for k, v in h.items() if not k.startswith("eval/")} for h in run]
               for run in (resumed, uninterrupted)]
    assert strip_time(no_eval[0]) == strip_time(no_eval[1])
    assert resumed[-1]["eval/success_once"] == uninterrupted[-1]["eval/success_once"]
    with pytest.raises(ConfigError, match=r"max_minutes = 0.0 is outside its valid range \(0, inf\)"):
        train_config(sft_checkpoint, tmp_path / "x", max_minutes=0.0)


def test_resume_errors_are_clear(sft_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoints"):
        resume_trainer(tmp_path / "empty")
    Trainer(train_config(sft_checkpoint, tmp_path / "run", iterations=1), log=lambda *_: None).run()
    ckpt = tmp_path / "run" / "checkpoints" / "iter_000001"
    (ckpt / "optimizer.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        resume_trainer(tmp_path / "run")


def test_config_errors_name_the_key(sft_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="learner.lr_actr"):
        train_config(sft_checkpoint, tmp_path, learner={"lr_actr": 1.0})
    with pytest.raises(ConfigError, match="sampler.method"):
        Trainer(train_config(sft_checkpoint, tmp_path, sampler={"method": "ode"}), log=lambda *_: None)
    assert cli_main(["train", "builtin_flow_noise", "learner.nope=1"]) == 2


@pytest.fixture
def closed_envs(monkeypatch):
    """Ids of the built-in envs closed so far (``close`` recorded, then run as usual)."""
    from vla_rl.envs.builtin import ColorReachEnv

    closed: list[int] = []
    real = ColorReachEnv.close

    def close(self):
        closed.append(id(self))
        real(self)

    monkeypatch.setattr(ColorReachEnv, "close", close)
    return closed


def test_envs_are_released_however_a_trainer_ends(sft_checkpoint, tmp_path, closed_envs):
    """Worker envs hold a process per env, so every way out of a trainer closes them: the context manager
    (shared and separate evaluation envs), a failed construction, a failed resume, and `vla-rl eval`."""
    from vla_rl.eval.evaluate import evaluate_checkpoint

    with Trainer(train_config(sft_checkpoint, tmp_path / "a", iterations=1), log=lambda *_: None) as t:
        env = t.env
        t.run()
        assert closed_envs == []
    assert closed_envs == [id(env)] and t.env is None
    t.close()   # idempotent
    assert closed_envs == [id(env)]
    with pytest.raises(RuntimeError, match="closed"):
        t.run()
    closed_envs.clear()
    with Trainer(train_config(sft_checkpoint, tmp_path / "b", eval_episodes=4), log=lambda *_: None) as t:
        ids = {id(t.env), id(t.eval_env)}
    assert len(ids) == 2 and set(closed_envs) == ids
    closed_envs.clear()
    with pytest.raises(ConfigError, match="action_horizon"):   # fails after the env was built
        Trainer(train_config(sft_checkpoint, tmp_path / "c", execute=99), log=lambda *_: None)
    assert len(closed_envs) == 1
    closed_envs.clear()
    ckpt = tmp_path / "a" / "checkpoints" / "iter_000001"
    assert evaluate_checkpoint(ckpt, {"episodes": 4, "num_envs": 4})["eval/episodes"] == 4
    assert len(closed_envs) == 1
    closed_envs.clear()
    (ckpt / "optimizer.safetensors").write_bytes(b"\x00" * 10)   # found unreadable before any env is built
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        resume_trainer(tmp_path / "a", log=lambda *_: None)
    assert closed_envs == []
    from safetensors.torch import save_file

    save_file({"state.0.exp_avg": torch.zeros(1)}, str(ckpt / "optimizer.safetensors"))  # readable, does not fit
    with pytest.raises(CheckpointError, match=r"state.0.exp_avg has shape \(1,\)"):
        resume_trainer(tmp_path / "a", log=lambda *_: None)
    assert len(closed_envs) == 1


def test_cli_train_and_eval(sft_checkpoint, tmp_path, capsys):
    out = tmp_path / "cli"
    # overrides on both sides of a flag are all taken
    rc = cli_main(["train", "builtin_flow_sde", f"init={sft_checkpoint}", f"out={out}", "--no-progress",
                   "iterations=1", "env.num_envs=8", "eval_episodes=8", "rollout_chunks=2", "learner.update_epochs=1",
                   "tensorboard=false"])
    assert rc == 0
    assert "eval success" in capsys.readouterr().out
    rc = cli_main(["eval", str(out / "checkpoints" / "iter_000001"), "episodes=8", "num_envs=8",
                   "env.builtin.max_episode_steps=12"])  # env fields can be overridden at evaluation
    assert rc == 0
    assert "eval/success_once" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["eval", str(out), "--bogus-flag"])
    assert "unrecognized arguments: --bogus-flag" in capsys.readouterr().err


def test_eval_with_the_stochastic_samplers(sft_checkpoint, monkeypatch, capsys):
    """``vla-rl eval CKPT sampler.method=noise`` (or sde) evaluates the stochastic policy RL trains; ODE by default;
    the flat spelling of earlier versions (``method=noise``) is refused with the new one."""
    import vla_rl.eval.evaluate as ev

    seen, real = [], ev.evaluate_episodes
    monkeypatch.setattr(ev, "evaluate_episodes", lambda *a, **k: seen.append(k["sampler"]) or real(*a, **k))
    base = {"episodes": 4, "num_envs": 4}
    m_ode = ev.evaluate_checkpoint(sft_checkpoint, base)
    m_sde = ev.evaluate_checkpoint(sft_checkpoint, {**base, "sampler": {"method": "sde", "noise_level": 0.8,
                                                                        "sde_mode": "all"}})
    ev.evaluate_checkpoint(sft_checkpoint, {**base, "sampler": {"method": "noise", "num_steps": 2}})
    assert [(s.method, s.num_steps) for s in seen] == [("ode", 4), ("sde", 4), ("noise", 2)]
    assert (seen[1].noise_level, seen[1].sde_mode) == (0.8, "all")
    assert m_ode["eval/episodes"] == m_sde["eval/episodes"] == 4
    assert cli_main(["eval", str(sft_checkpoint), "sampler.method=euler"]) == 2
    assert "method" in capsys.readouterr().err
    assert cli_main(["eval", str(sft_checkpoint), "method=noise"]) == 2
    assert "method is now sampler.method: write sampler.method=noise instead" in capsys.readouterr().err


def test_grpo_chunk_advantages_by_hand():
    from vla_rl.rl.algorithms import GRPO, GRPOConfig
    from vla_rl.rl.rollout import Rollout

    # 4 envs in 2 groups, 3 chunks. Env 0 succeeds at chunk 1 (return 1.5), env 1 never ends (return 0.3);
    # group 1: both fail at chunk 0 (degenerate, filtered).
    rewards = torch.tensor([[0.5, 0.1, 0.0, 0.0], [1.0, 0.1, 9.0, 9.0], [7.0, 0.1, 9.0, 9.0]])
    term = torch.tensor([[False, False, True, True], [True, False, False, False], [False, False, False, False]])
    success = torch.tensor([[False, False, False, False], [True, False, False, False], [False] * 4])
    z = torch.zeros(3, 4)
    ro = Rollout(obs={}, chain=z, stochastic=z, log_probs=z, entropy=z, values=z, rewards=rewards,
                 terminated=term, truncated=torch.zeros_like(term), success=success, final_values=z,
                 last_values=torch.zeros(4), sampler=SamplerConfig(4, "sde"), execute=8)
    out = GRPO(GRPOConfig(group_size=2, filter=True)).advantages(ro)
    adv, mask = out.advantages, out.mask
    assert out.returns is None   # no critic
    a = (1.5 - 0.9) / (0.6 + 1e-6)
    torch.testing.assert_close(adv[:, 0], torch.tensor([a, a, 0.0]))
    torch.testing.assert_close(adv[:, 1], torch.tensor([-a, -a, -a]))
    assert mask[:, 0].tolist() == [True, True, False] and mask[:, 1].all() and not mask[:, 2:].any()


def test_grpo_run_groups_envs_by_initial_state(sft_checkpoint, tmp_path):
    cfg = train_config(sft_checkpoint, tmp_path / "grpo", iterations=1, env={"num_envs": 8},
                       algorithm={"name": "grpo", "grpo": {"group_size": 4}},
                       learner={"update_epochs": 1, "minibatches": 1})
    trainer = Trainer(cfg, log=lambda *_: None)
    obs = trainer.env.reset(seed=3, group_size=4)
    assert torch.equal(obs["images"][0], obs["images"][3]) and not torch.equal(obs["images"][0], obs["images"][4])
    history = trainer.run()
    assert history[-1]["iteration"] == 1 and "train/samples" in history[-1]


def test_critic_warm_up_moves_the_value_head_only(sft_checkpoint):
    from vla_rl.checkpoint.policy import load_policy
    from vla_rl.envs.builtin import ColorReachEnv
    from vla_rl.rl.algorithms import PPO, PPOConfig
    from vla_rl.rl.learner import Learner, LearnerConfig
    from vla_rl.rl.rollout import collect_rollout

    model, norm, _ = load_policy(sft_checkpoint)
    actor = Actor(model, norm)
    env = ColorReachEnv(8, seed=0)
    learner = Learner(actor, LearnerConfig(critic_warmup_iters=1, update_epochs=1, minibatches=2), PPO(PPOConfig()))
    ro, _ = collect_rollout(actor, env, env.reset(seed=0), num_chunks=2, sampler=SamplerConfig(4, "sde"),
                            execute=8, generator=torch.Generator().manual_seed(0))

    def snapshot():
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    before = snapshot()
    learner.update(ro, iteration=0)  # warm-up: only the critic learns, the policy stays where it was
    after = snapshot()
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and all(n.startswith("value_head") for n in moved), moved
    learner.update(ro, iteration=1)  # after the warm-up the policy trains too
    assert any(not torch.equal(after[n], p) for n, p in model.named_parameters() if not n.startswith("value_head"))


@pytest.mark.parametrize("method", ["sde", "noise"])
def test_the_rollout_records_its_sampler_and_the_learner_recomputes_its_log_probs(sft_checkpoint, method):
    """Before any update the learner's recomputed chunk log-probs equal the rollout's own (ratio 1), read with
    the sampler and ``execute`` the rollout recorded."""
    from vla_rl.checkpoint.policy import load_policy
    from vla_rl.envs.builtin import ColorReachEnv
    from vla_rl.policies import flow
    from vla_rl.rl.losses import LogProbConfig, aggregate_log_prob
    from vla_rl.rl.rollout import collect_rollout

    model, norm, _ = load_policy(sft_checkpoint)
    actor = Actor(model, norm)
    env = ColorReachEnv(4, seed=0)
    sampler = SamplerConfig(3, method, noise_level=0.4)
    ro, _ = collect_rollout(actor, env, env.reset(seed=0), num_chunks=2, sampler=sampler, execute=5,
                            generator=torch.Generator().manual_seed(0))
    assert ro.sampler == sampler and ro.execute == 5 and ro.log_probs.shape[:3] == (2, 4, 3)
    flat = lambda x: x.reshape(8, *x.shape[2:])  # noqa: E731
    with torch.no_grad():
        re = flow.chain_log_prob(model.field(model.encode_prefix({k: flat(v) for k, v in ro.obs.items()})),
                                 flat(ro.chain), flat(ro.stochastic), method=method, noise_level=0.4)
    cfg = LogProbConfig()
    old = aggregate_log_prob(flat(ro.log_probs), flat(ro.stochastic), cfg, executed=5, dim_mask=actor.dim_mask)
    new = aggregate_log_prob(re.log_probs, flat(ro.stochastic), cfg, executed=5, dim_mask=actor.dim_mask)
    torch.testing.assert_close(new, old, atol=1e-4, rtol=1e-5)


def test_each_observation_is_prepared_once_and_the_learner_reuses_the_stored_inputs(sft_checkpoint, monkeypatch):
    """The rollout prepares (checks, tokenizes) each observation once, through its actor: each chunk's, the one after
    the last chunk and each truncated episode's final one; the learner encodes the stored inputs without preparing
    them again."""
    from vla_rl.checkpoint.policy import load_policy
    from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv
    from vla_rl.rl.algorithms import PPO, PPOConfig
    from vla_rl.rl.learner import Learner, LearnerConfig
    from vla_rl.rl.rollout import collect_rollout

    model, norm, _ = load_policy(sft_checkpoint)
    actor = Actor(model, norm)
    env = ColorReachEnv(4, config=ColorReachConfig(max_episode_steps=8), seed=0)   # truncated after chunk 1
    calls, real = [], model.prepare
    monkeypatch.setattr(model, "prepare", lambda obs: calls.append(len(obs["state"])) or real(obs))
    ro, _ = collect_rollout(actor, env, env.reset(seed=0), num_chunks=3, sampler=SamplerConfig(2, "noise"),
                            execute=8, generator=torch.Generator().manual_seed(0))
    truncated = int(ro.truncated.any(dim=1).sum())
    assert truncated >= 1 and len(calls) == 3 + 1 + truncated
    assert set(ro.obs) == {"images", "image_mask", "state", "tokens", "token_mask"}
    calls.clear()
    Learner(actor, LearnerConfig(update_epochs=1, minibatches=2), PPO(PPOConfig())).update(ro, iteration=0)
    assert calls == []


def test_freeze_prefix_leaves_the_models_prefix_group_out_of_the_optimizer():
    from vla_rl.rl.algorithms import PPO, PPOConfig
    from vla_rl.rl.learner import Learner, LearnerConfig

    model = FlowPolicy(policy_preset("tiny", SMALL))
    learner = Learner(Actor(model, NormStats(Stats.identity(4), Stats.identity(2))), LearnerConfig(freeze_prefix=True),
                      PPO(PPOConfig()))
    groups = model.parameter_groups()
    optimized = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert not any(p.requires_grad or id(p) in optimized for p in groups["prefix"].values())
    assert all(id(p) in optimized for g in ("expert", "value") for p in groups[g].values())


def test_actor_learning_rate_schedule_by_hand():
    from vla_rl.rl.learner import LearnerConfig, actor_lr_scale

    cfg = LearnerConfig(critic_warmup_iters=2, actor_lr_warmup_iters=4)
    assert [actor_lr_scale(i, cfg) for i in range(8)] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [actor_lr_scale(i, LearnerConfig()) for i in range(3)] == [1.0, 1.0, 1.0]
    # constant (the default) ignores the run length
    assert [actor_lr_scale(i, cfg, 8) for i in range(8)] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_actor_learning_rate_decay_by_hand():
    import math

    from vla_rl.rl.learner import LearnerConfig, actor_lr_scale

    # critic warm-up 1, ramp over 2 (0.5 at iteration 1, 1.0 at 2), then linear to 0.2 at the last iteration (6)
    lin = LearnerConfig(critic_warmup_iters=1, actor_lr_warmup_iters=2, actor_lr_decay="linear", actor_lr_final=0.2)
    got = [actor_lr_scale(i, lin, 7) for i in range(9)]
    want = [0.0, 0.5, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2]  # past the end (a resumed, extended run): stays at 0.2
    assert all(math.isclose(g, w) for g, w in zip(got, want, strict=True)), got
    # cosine from iteration 0 over 5 iterations: 1, (1 + cos(pi/4)) / 2, 1/2, (1 - cos(pi/4)) / 2, 0
    cos = LearnerConfig(actor_lr_decay="cosine", actor_lr_final=0.0)
    got = [actor_lr_scale(i, cos, 5) for i in range(5)]
    want = [1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2, 0.0]
    assert all(math.isclose(g, w, abs_tol=1e-12) for g, w in zip(got, want, strict=True)), got
    assert actor_lr_scale(3, cos, None) == 1.0  # no run length known: no decay
    # linear from update 4 (after a ramp that ends at 1): 1 until 4, then to 0.2 at the last update (6)
    late = LearnerConfig(actor_lr_warmup_iters=2, actor_lr_decay="linear", actor_lr_final=0.2, actor_lr_decay_start=4)
    got = [actor_lr_scale(i, late, 7) for i in range(8)]
    want = [0.5, 1.0, 1.0, 1.0, 1.0, 0.6, 0.2, 0.2]
    assert all(math.isclose(g, w) for g, w in zip(got, want, strict=True)), got
    # step: the PickCube Flow-Noise preset's schedule (full lr to update 109, then 0.2 x lr), scaled down
    step = LearnerConfig(critic_warmup_iters=1, actor_lr_warmup_iters=2, actor_lr_decay="step", actor_lr_final=0.2,
                     actor_lr_decay_start=4)
    assert [actor_lr_scale(i, step) for i in range(7)] == [0.0, 0.5, 1.0, 1.0, 0.2, 0.2, 0.2]
    assert [actor_lr_scale(i, step, 5) for i in range(7)] == [0.0, 0.5, 1.0, 1.0, 0.2, 0.2, 0.2]
    for bad in ({"actor_lr_decay": "exp"}, {"actor_lr_final": 1.5}, {"actor_lr_final": -0.1},
                {"actor_lr_decay": "step"}, {"actor_lr_decay_start": -1}):
        with pytest.raises(ConfigError, match="actor_lr_"):
            LearnerConfig(**bad)


def test_trainer_decays_the_actor_learning_rate_over_the_run(sft_checkpoint, tmp_path):
    cfg = train_config(sft_checkpoint, tmp_path / "decay", iterations=3, eval_every=3, save_every=3,
                       learner={"update_epochs": 1, "minibatches": 1, "lr_actor": 1e-4, "actor_lr_decay": "linear",
                                "actor_lr_final": 0.5})
    trainer = Trainer(cfg, log=lambda *_: None)
    trainer.run()
    lrs = [h["train/lr_actor"] for h in trainer.history if "train/lr_actor" in h]
    assert lrs == pytest.approx([1e-4, 0.75e-4, 0.5e-4])
    actor_group = next(g for g in trainer.learner.optimizer.param_groups if g["name"] == "actor")
    assert actor_group["lr"] == pytest.approx(0.5e-4)  # what the optimizer really used last


def test_rollout_seeds_are_disjoint_across_iterations_and_away_from_demo_and_eval_seeds():
    # Worker envs give env i the seed rollout_seed + i. A seed of seed * 1_000_003 + iteration would make
    # iteration it use it .. it + 15 on 16 envs: 100 iterations would see 115 initial states, the demos' own.
    from vla_rl.eval.evaluate import EvalConfig
    from vla_rl.train.trainer import rollout_seed

    for seed in (0, 3):
        blocks = [set(range(rollout_seed(seed, it, 16), rollout_seed(seed, it, 16) + 16)) for it in range(200)]
        assert len(set().union(*blocks)) == 200 * 16
        assert min(min(b) for b in blocks) > EvalConfig().seed + 100_000   # demos: 0, 1, ...; eval: 10_000, ...
    assert rollout_seed(0, 5, 16) != rollout_seed(1, 5, 16)


def test_reward_scale_scales_the_value_targets(sft_checkpoint, tmp_path):
    from vla_rl.rl.algorithms import PPO, PPOConfig
    from vla_rl.rl.rollout import Rollout

    # 2 envs, 2 chunks; env 0 ends at chunk 0 (terminated), env 1 runs on and bootstraps from last_values.
    rewards = torch.tensor([[-4.0, -2.0], [-6.0, -8.0]])
    term = torch.tensor([[True, False], [False, False]])
    values = torch.tensor([[-0.1, -0.2], [-0.3, -0.4]])
    z = torch.zeros(2, 2)
    ro = Rollout(obs={}, chain=z, stochastic=z, log_probs=z, entropy=z, values=values, rewards=rewards,
                 terminated=term, truncated=torch.zeros_like(term), success=term, final_values=z,
                 last_values=torch.tensor([-0.5, -0.6]), sampler=SamplerConfig(4, "sde"), execute=8)
    ret = PPO(PPOConfig(reward_scale=0.05, gamma=0.9, lam=1.0, normalize_advantages=False)).advantages(ro).returns
    # lam = 1: returns are the discounted scaled rewards plus the discounted bootstrap value
    expected = torch.tensor([[-0.2, -0.1 + 0.9 * (-0.4 + 0.9 * -0.6)], [-0.3 + 0.9 * -0.5, -0.4 + 0.9 * -0.6]])
    torch.testing.assert_close(ret, expected)
    with pytest.raises(ConfigError, match="reward_scale"):
        train_config(sft_checkpoint, tmp_path, algorithm={"ppo": {"reward_scale": 0.0}})


def test_actor_and_critic_gradients_are_clipped_separately():
    from vla_rl.rl.learner import clip_grad_norms

    actor_p, critic_p = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([{"params": [actor_p], "name": "actor"}, {"params": [critic_p], "name": "critic"}])
    actor_p.grad = torch.full((4,), 15.0)                  # norm 30: a chunk log-prob's policy gradient
    critic_p.grad = torch.tensor([0.3, 0.0, 0.4])          # norm 0.5
    norm_a, norm_c = clip_grad_norms(opt, 1.0)
    assert float(norm_a) == pytest.approx(30.0) and float(norm_c) == pytest.approx(0.5)
    assert float(actor_p.grad.norm()) == pytest.approx(1.0, rel=1e-4)
    torch.testing.assert_close(critic_p.grad, torch.tensor([0.3, 0.0, 0.4]))  # a joint clip gave it 1/30
    critic_p.grad = None                                   # a group without gradients reports 0
    assert float(clip_grad_norms(opt, 1.0)[1]) == 0.0


def test_evaluation_rounds_cover_distinct_initial_states():
    """Worker envs give env i the seed ``seed + i``; every evaluated episode must start from its own seed."""
    from types import SimpleNamespace

    from vla_rl.envs.base import ChunkStep
    from vla_rl.eval.evaluate import evaluate

    class SeedPerEnv:  # the worker-env seeding convention; every episode ends (successfully) in one chunk
        num_envs = 4

        def __init__(self):
            self.started: list[int] = []

        def reset(self, seed):
            self.seeds = [seed + i for i in range(self.num_envs)]
            self.started += self.seeds
            return {}

        def step(self, chunk):
            n = self.num_envs
            ones, yes = torch.ones(n), torch.ones(n, dtype=torch.bool)
            episodes = {"env_index": torch.arange(n), "success_once": torch.tensor([s % 2 == 0 for s in self.seeds]),
                        "success_at_end": yes, "return": ones, "length": ones}
            return ChunkStep(obs={}, rewards=ones[:, None], terminated=yes, truncated=~yes, success=yes,
                             steps=ones.long(), final_obs={}, episodes=episodes)

    actor = SimpleNamespace(model=SimpleNamespace(device=torch.device("cpu")), draw_keyed=lambda keys, sampler: None,
                            chunk=lambda obs, sampler, draws: torch.zeros(4, 2, 1))
    env = SeedPerEnv()
    m = evaluate(actor, env, num_episodes=10, seed=100)
    assert env.started == list(range(100, 112))  # 3 rounds of 4; the last round counts its first 2
    assert m["eval/success_once"] == 0.5          # seeds 100..109: the even ones succeed


def test_evaluation_shares_the_training_env_and_gets_the_same_numbers(sft_checkpoint, tmp_path):
    """eval_episodes >= num_envs: evaluations run on the training env (no second set of worker processes),
    and give what a fresh env of the same size gives, even right after a rollout left it mid-episode."""
    from dataclasses import replace

    from vla_rl.envs.registry import make_env
    from vla_rl.eval.evaluate import evaluate

    cfg = train_config(sft_checkpoint, tmp_path / "shared", iterations=1, eval_episodes=12)
    trainer = Trainer(cfg, log=lambda *_: None)
    assert trainer.eval_env is trainer.env
    trainer.run()  # a rollout and an update: the env is left wherever the rollout ended
    fresh = make_env(cfg.env, num_envs=cfg.env.num_envs, device=torch.device("cpu"), seed=123)
    expected = evaluate(trainer.actor, fresh, num_episodes=12, sampler=replace(cfg.sampler, method="ode"),
                        execute=cfg.execute, seed=cfg.eval_seed)
    assert trainer.evaluate() == expected
    # A batch larger than the evaluation gets its own env of eval_episodes envs.
    small = Trainer(train_config(sft_checkpoint, tmp_path / "separate", eval_episodes=4), log=lambda *_: None)
    assert small.eval_env is not small.env and small.eval_env.num_envs == 4


def test_first_episode_mask_marks_each_envs_first_ended_episode():
    from vla_rl.rl.rollout import first_episode_mask

    assert first_episode_mask([3, 1, 3, 0, 1, 3]) == [True, True, False, True, False, False]
    assert first_episode_mask([]) == []


def test_rollout_success_over_first_episodes_counts_every_env_once(sft_checkpoint, tmp_path):
    """With a rollout as long as the episode limit (2 chunks x 8 = 16 steps) every env's first episode
    ends inside it, so exactly num_envs first episodes are scored, however many second ones end too."""
    history = Trainer(train_config(sft_checkpoint, tmp_path / "run", iterations=2), log=lambda *_: None).run()
    for h in history[1:]:
        assert h["rollout/first_episodes"] == 8
        assert (h["rollout/success_first"] * 8).is_integer()   # a count over exactly those 8 episodes


def test_best_checkpoint_is_the_best_evaluation_and_survives_resume(sft_checkpoint, tmp_path):
    """checkpoints/best holds the weights of the first iteration with the highest evaluation so far, across
    a resume, and is a policy folder ``vla-rl eval`` reads (it reproduces the recorded success)."""
    from vla_rl.checkpoint.folders import read_tensors, read_yaml_file
    from vla_rl.eval.evaluate import evaluate_checkpoint

    # A large actor lr so the evaluations move; every checkpoint kept so each iteration's weights can be compared.
    # Resumed after 4 of 5 iterations: with these seeds iteration 4 sets the maximum and 5 ties it, so a trainer
    # that forgot the history before the resume would overwrite best with iteration 5.
    over = {"iterations": 4, "eval_episodes": 8, "keep_last": 10, "learner": {"lr_actor": 3e-3, "update_epochs": 2,
                                                                              "minibatches": 2}}
    Trainer(train_config(sft_checkpoint, tmp_path, **over), log=lambda *_: None).run()
    history = resume_trainer(tmp_path, overrides={"iterations": 5}, log=lambda *_: None).run()
    evals = [(h["iteration"], h["eval/success_once"]) for h in history if "eval/success_once" in h]
    assert [i for i, _ in evals] == [0, 1, 2, 3, 4, 5]
    best_it = max(evals, key=lambda e: (e[1], -e[0]))[0]          # first iteration of the maximum
    best = tmp_path / "checkpoints" / "best"
    info = read_yaml_file(best / "best.yaml")
    assert info["iteration"] == best_it and info["eval/success_once"] == dict(evals)[best_it]
    source = sft_checkpoint if best_it == 0 else tmp_path / "checkpoints" / f"iter_{best_it:06d}"
    want, got = read_tensors(source / "model.safetensors"), read_tensors(best / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    again = evaluate_checkpoint(best, {"episodes": 8, "num_envs": 8})
    assert again["eval/success_once"] == dict(evals)[best_it]


def test_eval_method_train_evaluates_with_the_rollout_sampler(sft_checkpoint, tmp_path, monkeypatch):
    import vla_rl.train.trainer as tr

    seen, real = [], tr.evaluate
    monkeypatch.setattr(tr, "evaluate", lambda *a, **k: seen.append(k["sampler"]) or real(*a, **k))
    sampler = {"num_steps": 3, "method": "sde", "sde_mode": "all", "noise_level": 0.7}
    Trainer(train_config(sft_checkpoint, tmp_path / "t", iterations=1, eval_method="train", keep_best=False,
                   sampler=sampler), log=lambda *_: None).run()
    Trainer(train_config(sft_checkpoint, tmp_path / "o", iterations=1, sampler=sampler), log=lambda *_: None).run()
    # iteration 0 also measures the exploration noise's cost: the other sampler on the same episodes
    sde, ode = ("sde", 3, 0.7, "all"), ("ode", 3, 0.7, "all")
    assert [(s.method, s.num_steps, s.noise_level, s.sde_mode) for s in seen] == [sde, ode, sde, ode, sde, ode]
    assert not (tmp_path / "t" / "checkpoints" / "best").exists()     # keep_best=False
    assert (tmp_path / "o" / "checkpoints" / "best" / "best.yaml").is_file()
    with pytest.raises(ConfigError, match="eval_method"):
        train_config(sft_checkpoint, tmp_path, eval_method="stochastic")


def test_envs_forget_their_history_where_a_run_can_resume(sft_checkpoint, tmp_path, monkeypatch):
    """Simulators whose physics carries state across episodes (ManiSkill's CPU workers) are told to forget it at
    the start of every iteration that starts at a checkpoint: the same iterations in an uninterrupted run and in
    one resumed from any of its checkpoints, whose envs are new (what makes resumed ManiSkill runs exact)."""
    from vla_rl.envs.builtin import ColorReachEnv

    calls: list[int] = []
    trainer = None
    monkeypatch.setattr(ColorReachEnv, "forget_history", lambda self: calls.append(trainer.iteration),
                        raising=False)
    over = {"iterations": 4, "save_every": 2, "eval_every": 4, "rollout_chunks": 1}
    trainer = Trainer(train_config(sft_checkpoint, tmp_path / "full", **over), log=lambda *_: None)
    with trainer:
        trainer.run()
    assert calls == [0, 2]                           # the start, and after the save of iteration 2
    calls.clear()
    trainer = Trainer(train_config(sft_checkpoint, tmp_path / "part", **{**over, "iterations": 2}),
                      log=lambda *_: None)
    with trainer:
        trainer.run()
    trainer = resume_trainer(tmp_path / "part", overrides={"iterations": 4}, log=lambda *_: None)
    with trainer:
        trainer.run()
    assert calls == [0, 2]                           # the part run's start, then the resumed run's (at 2)
