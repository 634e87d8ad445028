"""The RL methods behind the Algorithm seam, against known answers: RLOO's leave-one-out baselines, DAPO's clip
asymmetry and group filter, FPO's ratio (the exponentiated CFM-loss drop on fixed draws, 1 at the old parameters)
and an FPO step on a 1-D two-mode target; each method through a short run on the built-in task; old configs."""

import math

import pytest
import torch
from helpers import train_config

from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict, to_dict
from vla_rl.policies.actor import SamplerConfig
from vla_rl.rl import losses
from vla_rl.rl.algorithms import ALGORITHMS, AlgorithmConfig, make_algorithm
from vla_rl.rl.algorithms.dapo import DAPO, DAPOConfig
from vla_rl.rl.algorithms.fpo import (
    chunk_losses,
    clamp_straight_through,
    fpo_ratio,
    trust_region_objective,
)
from vla_rl.rl.algorithms.rloo import RLOO, RLOOConfig, leave_one_out
from vla_rl.rl.rollout import Rollout
from vla_rl.train.trainer import TrainConfig, Trainer


def episode_rollout(rewards, success, t_len=3):
    """A rollout of N envs whose first episodes end at chunk 1 with the given rewards and successes."""
    n = len(rewards)
    z = torch.zeros(t_len, n)
    r = torch.zeros(t_len, n)
    r[1] = torch.tensor(rewards, dtype=torch.float32)
    term = torch.zeros(t_len, n, dtype=torch.bool)
    term[1] = True
    succ = torch.zeros(t_len, n, dtype=torch.bool)
    succ[1] = torch.tensor(success)
    return Rollout(obs={}, chain=z, stochastic=z, log_probs=z, entropy=z, values=z, rewards=r, terminated=term,
                   truncated=torch.zeros_like(term), success=succ, final_values=z, last_values=torch.zeros(n),
                   sampler=SamplerConfig(4, "sde"), execute=8)


# ----------------------------------------------------------------------------------------------------
# RLOO
# ----------------------------------------------------------------------------------------------------
def test_rloo_leave_one_out_against_the_closed_form():
    returns = torch.tensor([1.0, 0.0, 3.0, 2.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    want = [1 - (0 + 3) / 2, 0 - (1 + 3) / 2, 3 - (1 + 0) / 2, 2 - 5.0, 5 - (2 + 5) / 2, 5 - (2 + 5) / 2]
    torch.testing.assert_close(leave_one_out(returns, groups), torch.tensor(want))
    k = 3   # the same as k / (k - 1) (R_i - group mean)
    means = torch.tensor([4 / 3] * 3 + [4.0] * 3)
    torch.testing.assert_close(leave_one_out(returns, groups), k / (k - 1) * (returns - means))


def test_rloo_advantages_reach_every_chunk_of_the_first_episode():
    ro = episode_rollout([1.0, 0.0, 1.0, 1.0], [True, False, True, True])
    adv = RLOO(RLOOConfig(group_size=2)).advantages(ro)
    assert adv.returns is None   # no critic
    torch.testing.assert_close(adv.advantages[:2, 0], torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(adv.advantages[:2, 1], torch.tensor([-1.0, -1.0]))
    assert not adv.advantages[:, 2:].any() and adv.mask[:2].all() and not adv.mask[2].any()


# ----------------------------------------------------------------------------------------------------
# DAPO
# ----------------------------------------------------------------------------------------------------
def test_dapo_clip_higher_is_asymmetric():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.25, 1.25, 0.75, 0.7]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    sym, _ = losses.ppo_policy_loss(new_log_prob=new[:1], old_log_prob=old[:1], advantages=adv[:1], clip=0.2,
                                    dual_clip=None)
    high, m = losses.ppo_policy_loss(new_log_prob=new[:1], old_log_prob=old[:1], advantages=adv[:1], clip=0.2,
                                     clip_high=0.28, dual_clip=None)
    assert sym.item() == pytest.approx(-1.2) and high.item() == pytest.approx(-1.25)   # 1.25 < 1 + 0.28: kept
    assert m["losses/clipfrac"] == 0.0
    # Below 1 the clip is the symmetric one: a ratio of 0.75 with A < 0 is bounded at 1 - 0.2 either way.
    low, _ = losses.ppo_policy_loss(new_log_prob=new[2:3], old_log_prob=old[2:3], advantages=adv[2:3], clip=0.2,
                                    clip_high=0.28, dual_clip=None)
    assert low.item() == pytest.approx(0.8)
    with pytest.raises(ConfigError, match="clip_high = 0.1 is below clip"):
        DAPOConfig(clip=0.2, clip_high=0.1)


def test_dapo_drops_groups_that_all_succeeded_or_all_failed():
    # groups of 2: (success, fail) informative; (success, success) and (fail, fail) not
    ro = episode_rollout([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [True, False, True, True, False, False])
    dapo = DAPO(DAPOConfig(group_size=2))
    assert dapo.keep_envs(ro).tolist() == [True, True, False, False, False, False]
    adv = dapo.advantages(ro)
    assert adv.mask[:, 2:].sum() == 0 and adv.mask[:2, :2].all()
    assert adv.advantages[0, 0] > 0 > adv.advantages[0, 1]


def test_dapo_tops_the_batch_up_from_further_rollouts(sft_checkpoint, tmp_path):
    cfg = train_config(sft_checkpoint, tmp_path / "dapo", iterations=1, env={"num_envs": 8},
                       algorithm={"name": "dapo", "dapo": {"group_size": 2, "max_rollouts": 3}},
                       learner={"update_epochs": 1, "minibatches": 1})
    trainer = Trainer(cfg, log=lambda *_: None)
    seen = []
    original = trainer._rollout

    def counting(seed):
        ro = original(seed)
        seen.append((seed, int(trainer.algorithm.keep_envs(ro).sum())))
        return ro

    trainer._rollout = counting
    ro = trainer._collect(0)
    kept = sum(k for _, k in seen)
    assert len({s for s, _ in seen}) == len(seen)           # every rollout on its own seeds
    assert len(seen) == 3 or kept >= 8                       # stopped when full or out of rollouts
    assert ro.values.shape[1] == min(8, kept) or kept == 0    # the batch: the kept envs, at most one rollout's
    if kept:
        assert bool(trainer.algorithm.keep_envs(ro).all())  # only informative groups in it
    assert ro.env_steps >= 8


# ----------------------------------------------------------------------------------------------------
# FPO
# ----------------------------------------------------------------------------------------------------
def test_fpo_ratio_is_the_exponentiated_loss_drop():
    old = torch.tensor([[1.0, 2.0, 0.5], [0.2, 0.2, 0.2]])
    new = torch.tensor([[0.5, 2.5, 0.5], [0.1, 0.3, 0.2]])
    torch.testing.assert_close(fpo_ratio(old, new, per_sample=True), torch.exp(old - new))
    fpo = fpo_ratio(old, new, per_sample=False)   # FPO: one ratio of the mean losses, repeated over the draws
    torch.testing.assert_close(fpo[:, 0], torch.exp(old.mean(1) - new.mean(1)))
    assert torch.equal(fpo[:, 0], fpo[:, 2])
    torch.testing.assert_close(fpo_ratio(old, old, per_sample=True), torch.ones_like(old))
    # The clamp bounds the value, not the gradient (straight-through).
    x = torch.tensor([-9.0, 0.5, 9.0], requires_grad=True)
    y = clamp_straight_through(x, 5.0)
    assert y.tolist() == [-5.0, 0.5, 5.0]
    y.sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0]


def test_fpo_trust_regions():
    ratio = torch.tensor([[1.5], [0.5]])
    adv = torch.tensor([2.0, -2.0])
    ppo = trust_region_objective(ratio, adv, clip=0.2, kind="ppo")
    spo = trust_region_objective(ratio, adv, clip=0.2, kind="spo")
    aspo = trust_region_objective(ratio, adv, clip=0.2, kind="aspo")
    assert ppo[0, 0].item() == pytest.approx(1.2 * 2) and ppo[1, 0].item() == pytest.approx(-0.8 * 2)
    assert spo[1, 0].item() == pytest.approx(0.5 * -2 - 2 / 0.4 * 0.25)
    assert aspo[0, 0] == ppo[0, 0] and aspo[1, 0] == spo[1, 0]   # PPO where A >= 0, SPO where A < 0


def test_fpo_chunk_loss_averages_real_dims_and_sums_executed_actions():
    err = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    mask = torch.tensor([True, True, True, False])
    got = chunk_losses(err, execute=2, dim_mask=mask)
    want = err[:, :2, :3].mean(-1).sum(-1)
    torch.testing.assert_close(got, want)


def test_fpo_ratio_is_one_at_the_sampling_parameters(sft_checkpoint, tmp_path):
    """Through the real path: the draws and old losses recorded at rollout time, the loss's recomputation on the
    same draws before any step: every ratio 1 (approx-KL 0)."""
    cfg = train_config(sft_checkpoint, tmp_path / "fpo", iterations=1, sampler={"num_steps": 4, "method": "ode"},
                       algorithm={"name": "fpo", "fpo": {"num_draws": 3}},
                       learner={"update_epochs": 1, "minibatches": 1})
    trainer = Trainer(cfg, log=lambda *_: None)
    ro = trainer._collect(0)
    pcfg = trainer.actor.model_config
    assert ro.extras["fpo_old_loss"].shape == (2, 8, 3)
    assert ro.extras["fpo_eps"].shape == (2, 8, 3, pcfg.action_horizon, pcfg.action_dim)
    from vla_rl.rl.algorithms.seam import Batch, Step
    algo = trainer.algorithm
    step = Step(ro.sampler, ro.execute, trainer.actor.dim_mask)
    batch = algo.prepare(Batch.of(ro, algo.advantages(ro)), step)
    with torch.no_grad():
        _, m = algo.loss(trainer.actor, batch, step)
    assert m["losses/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert m["losses/approx_kl"] == pytest.approx(0.0, abs=1e-6)


def two_mode_policy(seed: int):
    """A 1-D flow policy (velocity MLP of (x, t)) fitted by conditional flow matching to two modes, -1 and +1, of
    equal mass; returns (field, its network, an ODE sampler of it)."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.SiLU(), torch.nn.Linear(64, 64), torch.nn.SiLU(),
                              torch.nn.Linear(64, 1))
    field = lambda x, t: net(torch.cat([x.reshape(-1, 1), t.reshape(-1, 1)], 1)).reshape(x.shape)  # noqa: E731
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(600):
        a = torch.where(torch.rand(256) < 0.5, -1.0, 1.0)[:, None, None] + 0.05 * torch.randn(256, 1, 1)
        eps, t = torch.randn_like(a), torch.rand(256)
        x = t[:, None, None] * eps + (1 - t[:, None, None]) * a
        loss = (field(x, t) - (eps - a)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def sample(noise):
        x = noise
        with torch.no_grad():
            for k in range(10):
                x = x - 0.1 * field(x, torch.full((x.shape[0],), 1 - k / 10))
        return x

    return field, net, sample


def fpo_iterations(field, net, sample, better: float, *, iterations: int = 1, n: int = 512, m: int = 8):
    """FPO++ iterations (fresh ODE samples from noise, advantage +1 for actions on the ``better`` side of 0 and -1
    on the other, M draws and their old CFM losses, 20 Adam steps on the ASPO objective of per-draw ratios)."""
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(iterations):
        actions = sample(torch.randn(n, 1, 1))
        adv = torch.sign(actions[:, 0, 0]) * better
        t = 0.005 + 0.99 * torch.rand(n, m)
        eps = torch.randn(n, m, 1, 1)

        def draw_losses(actions=actions, t=t, eps=eps):
            x = t[..., None, None] * eps + (1 - t[..., None, None]) * actions[:, None]
            v = field(x.reshape(-1, 1, 1), t.reshape(-1))
            return (v.reshape(n, m, 1, 1) - (eps - actions[:, None])).pow(2).reshape(n, m)

        with torch.no_grad():
            old = draw_losses()
        for _ in range(20):
            ratio = fpo_ratio(old, draw_losses(), per_sample=True, clamp_log_ratio=5.0)
            loss = -trust_region_objective(ratio, adv, clip=0.2, kind="aspo").mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


@pytest.mark.parametrize("better", [1.0, -1.0])
def test_fpo_moves_probability_toward_the_higher_advantage_mode(better):
    """On a 1-D two-mode target with equal mass, FPO++ updates with advantages that favour one mode move the
    policy's mass to that mode (both directions: the move follows the advantage, not a bias of the setup)."""
    field, net, sample = two_mode_policy(seed=0)
    noise = torch.randn(2048, 1, 1, generator=torch.Generator().manual_seed(1))
    share = lambda: float((sample(noise) * better > 0).float().mean())  # noqa: E731
    shares = [share()]
    for _ in range(6):
        fpo_iterations(field, net, sample, better, iterations=1)
        shares.append(share())
    assert 0.35 < shares[0] < 0.65, shares
    # measured: +0.02-0.03 an iteration (0.47 -> 0.62 toward +1, 0.53 -> 0.68 toward -1)
    assert all(b > a for a, b in zip(shares, shares[1:])) and shares[-1] > shares[0] + 0.1, shares


# ----------------------------------------------------------------------------------------------------
# Every method through a run; configs
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_method_runs_an_iteration(name, sft_checkpoint, tmp_path):
    section = {"group_size": 4} if name in ("grpo", "rloo", "dapo") else {}
    method = "ode" if name == "fpo" else "sde"
    cfg = train_config(sft_checkpoint, tmp_path / name, iterations=1, env={"num_envs": 8},
                       sampler={"num_steps": 4, "method": method},
                       algorithm={"name": name, name: section}, learner={"update_epochs": 1, "minibatches": 2})
    history = Trainer(cfg, log=lambda *_: None).run()
    m = history[-1]
    assert m["iteration"] == 1 and "train/samples" in m
    assert ("losses/explained_variance" in m) == make_algorithm(cfg.algorithm).uses_critic or m["train/samples"] == 0


@pytest.mark.parametrize("name, method", [("ppo", "noise"), ("ppo", "sde"), ("grpo", "sde"), ("fpo", "ode")])
def test_methods_run_on_smolvla_unchanged(name, method, smolvla_checkpoint, tmp_path):
    """The algorithms reach the policy through the seam: a SmolVLA trains with Flow-Noise, Flow-SDE, GRPO and FPO++
    with the same configs as π0, and its loss moves its weights."""
    from vla_rl.checkpoint.policy import load_policy

    section = {"group_size": 4} if name == "grpo" else {}
    cfg = train_config(smolvla_checkpoint, tmp_path / name, iterations=1, env={"num_envs": 8},
                       sampler={"num_steps": 4, "method": method},
                       algorithm={"name": name, name: section}, learner={"update_epochs": 1, "minibatches": 2})
    history = Trainer(cfg, log=lambda *_: None).run()
    assert history[-1]["iteration"] == 1 and history[-1]["train/samples"] > 0
    before, _, _ = load_policy(smolvla_checkpoint)
    after, _, config = load_policy(tmp_path / name / "checkpoints" / "iter_000001")
    assert config["policy"]["arch"] == "smolvla"
    assert not torch.equal(before.expert_norm.weight, after.expert_norm.weight)


def test_likelihood_methods_refuse_the_ode_sampler_and_fpo_takes_it():
    for name in ("ppo", "grpo", "rloo", "dapo"):
        with pytest.raises(ConfigError, match=f"algorithm {name} needs"):
            from_dict(TrainConfig, {"sampler": {"method": "ode"}, "algorithm": {"name": name}})
    from_dict(TrainConfig, {"sampler": {"method": "ode"}, "algorithm": {"name": "fpo"}})


def test_only_the_chosen_section_may_be_set():
    with pytest.raises(ConfigError, match="rloo is set but name is 'ppo'"):
        from_dict(AlgorithmConfig, {"rloo": {"group_size": 4}})
    with pytest.raises(ConfigError, match="not one of"):
        from_dict(AlgorithmConfig, {"name": "reinforce"})


def test_old_ppo_sections_load_into_the_learner_and_algorithm_sections():
    old = from_dict(TrainConfig, {"ppo": {"lr_actor": 3e-5, "update_epochs": 2, "clip": 0.3, "gamma": 0.9}})
    assert (old.learner.lr_actor, old.learner.update_epochs) == (3e-5, 2)
    assert (old.algorithm.name, old.algorithm.ppo.clip, old.algorithm.ppo.gamma) == ("ppo", 0.3, 0.9)
    new = from_dict(TrainConfig, {"learner": {"lr_actor": 3e-5, "update_epochs": 2},
                                  "algorithm": {"ppo": {"clip": 0.3, "gamma": 0.9}}})
    assert to_dict(old) == to_dict(new)
    # GRPO runs of the old format trained the critic too: their configs keep it (they resume as they ran).
    grpo = from_dict(TrainConfig, {"ppo": {"algorithm": "grpo", "group_size": 4, "grpo_filter": False,
                                           "value_coef": 0.5}})
    assert grpo.algorithm.name == "grpo" and grpo.algorithm.grpo.group_size == 4 and not grpo.algorithm.grpo.filter
    assert grpo.algorithm.grpo.critic.value_coef == 0.5
    assert from_dict(TrainConfig, {"algorithm": {"name": "grpo"}}).algorithm.grpo.critic is None
    # An old key beside its new spelling (an old override of a new preset) names the new place.
    with pytest.raises(ConfigError, match=r"ppo.update_epochs is now learner.update_epochs: write "
                                          r"learner.update_epochs=1 instead"):
        from_dict(TrainConfig, {"learner": {"update_epochs": 2}, "ppo": {"update_epochs": 1}})
    with pytest.raises(ConfigError, match="ppo.algorithm=grpo is now algorithm.name"):
        from_dict(TrainConfig, {"algorithm": {"name": "rloo"}, "ppo": {"algorithm": "grpo"}})
    assert math.isfinite(old.learner.max_grad_norm)


def test_max_env_steps_ends_the_run_at_equal_env_steps(sft_checkpoint, tmp_path):
    """A run of 8 envs x 2 chunks x 8 actions collects 128 env-steps an iteration (episodes of 16 steps): a budget
    of 200 ends it after the second iteration, evaluated and saved, and a resume does not run on."""
    cfg = train_config(sft_checkpoint, tmp_path / "budget", iterations=5, eval_every=5, save_every=5,
                       env={"num_envs": 8}, max_env_steps=200)
    history = Trainer(cfg, log=lambda *_: None).run()
    assert [h["iteration"] for h in history] == [0, 1, 2] and history[-1]["time/env_steps"] >= 200
    assert "eval/success_once" in history[-1] and (tmp_path / "budget" / "checkpoints" / "iter_000002").is_dir()
    from vla_rl.train.trainer import resume_trainer
    again = resume_trainer(tmp_path / "budget", log=lambda *_: None).run()
    assert [h["iteration"] for h in again] == [0, 1, 2]

