"""Advantages and PPO losses against hand-computed answers."""

import pytest
import torch

from vla_rl.rl import advantages, losses


def scalar_gae(r, v, term, trunc, final_v, last_v, gamma, lam):
    """Per-env reference written as plainly as possible."""
    t_len = len(r)
    adv = [0.0] * t_len
    running = 0.0
    for t in reversed(range(t_len)):
        if trunc[t]:
            next_v = final_v[t]
        else:
            next_v = last_v if t == t_len - 1 else v[t + 1]
        delta = r[t] + gamma * (0.0 if term[t] else 1.0) * next_v - v[t]
        running = delta + gamma * lam * (0.0 if (term[t] or trunc[t]) else 1.0) * running
        adv[t] = running
    return adv


def test_gae_hand_made_trajectory_with_termination_and_truncation():
    # One env, 4 chunks: [r=1 | r=0 terminated | r=2 | r=1 truncated], gamma=0.5, lambda=1.
    r = torch.tensor([[1.0], [0.0], [2.0], [1.0]])
    v = torch.tensor([[0.5], [0.4], [1.0], [0.8]])
    term = torch.tensor([[False], [True], [False], [False]])
    trunc = torch.tensor([[False], [False], [False], [True]])
    final_v = torch.tensor([[0.0], [0.0], [0.0], [3.0]])
    adv, ret = advantages.gae(rewards=r, values=v, terminated=term, truncated=trunc, final_values=final_v,
                              last_values=torch.tensor([9.0]), gamma=0.5, lam=1.0)
    # Episode 2 (chunks 2-3) is truncated: bootstrap from V(final obs) = 3, never from last_values.
    a3 = 1.0 + 0.5 * 3.0 - 0.8                       # 1.7
    a2 = (2.0 + 0.5 * 0.8 - 1.0) + 0.5 * a3          # 1.4 + 0.85 = 2.25
    # Episode 1 terminates at chunk 1: no bootstrap.
    a1 = 0.0 - 0.4                                   # -0.4
    a0 = (1.0 + 0.5 * 0.4 - 0.5) + 0.5 * a1          # 0.7 - 0.2 = 0.5
    torch.testing.assert_close(adv[:, 0], torch.tensor([a0, a1, a2, a3]))
    torch.testing.assert_close(ret, adv + v)


def test_gae_vectorised_equals_scalar_loop():
    g = torch.Generator().manual_seed(0)
    t_len, n = 7, 5
    r = torch.randn(t_len, n, generator=g)
    v = torch.randn(t_len, n, generator=g)
    term = torch.rand(t_len, n, generator=g) < 0.2
    trunc = (torch.rand(t_len, n, generator=g) < 0.2) & ~term
    final_v = torch.randn(t_len, n, generator=g)
    last_v = torch.randn(n, generator=g)
    adv, _ = advantages.gae(rewards=r, values=v, terminated=term, truncated=trunc, final_values=final_v,
                            last_values=last_v, gamma=0.9, lam=0.95)
    for i in range(n):
        ref = scalar_gae(r[:, i].tolist(), v[:, i].tolist(), term[:, i].tolist(), trunc[:, i].tolist(),
                         final_v[:, i].tolist(), float(last_v[i]), 0.9, 0.95)
        torch.testing.assert_close(adv[:, i], torch.tensor(ref), atol=1e-5, rtol=1e-5)


def test_grpo_group_normalisation_and_degenerate_filter():
    returns = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    success = returns > 0.5
    adv, keep = advantages.grpo(returns=returns, groups=groups, success=success)
    m, s = 2 / 3, (((1 - 2 / 3) ** 2 * 2 + (2 / 3) ** 2) / 3) ** 0.5
    torch.testing.assert_close(adv[:3], (returns[:3] - m) / (s + 1e-6))
    assert keep.tolist() == [True, True, True, False, False, False, False]
    _, keep_all = advantages.grpo(returns=returns, groups=groups, success=success, filter_degenerate=False)
    assert keep_all.all()


def test_ppo_at_ratio_one_is_the_plain_policy_gradient():
    logp = torch.randn(6, requires_grad=True)
    adv = torch.randn(6)
    loss, m = losses.ppo_policy_loss(new_log_prob=logp, old_log_prob=logp.detach(), advantages=adv)
    assert m["losses/approx_kl"] == 0.0 and m["losses/clipfrac"] == 0.0
    loss.backward()
    # d/dlogp of -mean(A * exp(logp - logp_old)) at ratio 1 is -A / B: no bias from clipping.
    torch.testing.assert_close(logp.grad, -adv / 6)


def test_ppo_clipping_and_dual_clip():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 10.0, 1.0]))
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0])
    loss, m = losses.ppo_policy_loss(new_log_prob=new, old_log_prob=old, advantages=adv, clip=0.2,
                                     dual_clip=3.0)
    # sample 0: min(1.5, 1.2) * 1 -> -1.2; sample 1: max(0.5, 0.8)*(-1) -> loss 0.8;
    # sample 2: ratio 10 on a negative advantage -> 10, dual-clipped to 3; sample 3: ratio 1 -> -2.
    expected = (-1.2 + 0.8 + 3.0 - 2.0) / 4
    assert loss.item() == pytest.approx(expected)
    assert m["losses/clipfrac"] == pytest.approx(3 / 4)
    no_dual, _ = losses.ppo_policy_loss(new_log_prob=new, old_log_prob=old, advantages=adv, dual_clip=None)
    assert no_dual.item() == pytest.approx((-1.2 + 0.8 + 10.0 - 2.0) / 4)


def test_ppo_per_dimension_ratio_broadcasts_advantages():
    new = torch.zeros(3, 2)
    loss, _ = losses.ppo_policy_loss(new_log_prob=new, old_log_prob=new, advantages=torch.tensor([1.0, 2, 3]))
    assert loss.item() == pytest.approx(-2.0)


def test_value_loss_clipped_huber():
    v = torch.tensor([2.0, 0.0])
    old = torch.tensor([0.0, 0.0])
    ret = torch.tensor([2.0, 0.5])
    loss, _ = losses.value_loss(values=v, old_values=old, returns=ret, clip=0.2)
    # sample 0: unclipped error 0, clipped prediction 0.2 -> huber(1.8) = 1.3; sample 1: huber(0.5) = 0.125
    assert loss.item() == pytest.approx((1.3 + 0.125) / 2)
    assert losses.explained_variance(ret, ret) == pytest.approx(1.0)
