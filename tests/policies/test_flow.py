"""Flow math against known answers (no model involved)."""

import math

import pytest
import torch

from vla_rl.policies import flow


def gaussian_target_field(m: float, s: float):
    """Exact velocity E[eps - a | x_t] for a ~ N(m, s^2), eps ~ N(0, 1), x_t = t eps + (1-t) a."""

    def field(x, t):
        t = t[:, None, None]
        var_t = t**2 + (1 - t) ** 2 * s**2
        cov = t - (1 - t) * s**2
        return -m + cov / var_t * (x - (1 - t) * m)

    return field


def test_time_grid_runs_from_noise_to_action():
    g = flow.time_grid(4)
    assert torch.allclose(g, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


def test_constant_velocity_gives_exact_euler_endpoint():
    c = torch.tensor([0.3, -1.2, 2.0])
    x1 = torch.randn(5, 4, 3)
    out = flow.sample(lambda x, t: c.expand_as(x), x1, num_steps=7, method="ode")
    # Integrating dx/dt = c from t=1 to t=0 subtracts c exactly, whatever K.
    torch.testing.assert_close(out.actions, x1 - c, atol=1e-6, rtol=0)
    assert not out.stochastic.any()
    assert out.chain.shape == (5, 8, 4, 3)
    assert torch.equal(out.chain[:, 0], x1)
    assert torch.equal(out.log_probs, torch.zeros(5, 7, 4, 3))


@pytest.mark.parametrize(
    "method,sde_mode",
    [("ode", "all"), ("sde", "all"), ("sde", "mixed")],
)
def test_samples_match_gaussian_target_moments(method, sde_mode):
    m, s = 1.5, 0.5
    gen = torch.Generator().manual_seed(0)
    n = 20000
    x1 = torch.randn(n, 1, 2, generator=gen)
    out = flow.sample(gaussian_target_field(m, s), x1, num_steps=50, method=method, sde_mode=sde_mode,
                      noise_level=0.5, generator=gen)
    a = out.actions.flatten()
    # Statistical tolerance: ~5 standard errors of the mean / variance, plus O(1/K) discretisation.
    se_mean = s / math.sqrt(a.numel())
    assert abs(a.mean().item() - m) < 5 * se_mean + 0.01
    assert abs(a.var().item() - s**2) < 5 * s**2 * math.sqrt(2 / a.numel()) + 0.01


def test_sde_with_zero_noise_level_equals_ode():
    field = gaussian_target_field(0.7, 0.3)
    x1 = torch.randn(16, 4, 3)
    ode = flow.sample(field, x1, num_steps=10, method="ode")
    for mode in ("all", "mixed"):
        sde = flow.sample(field, x1, num_steps=10, method="sde", sde_mode=mode, noise_level=0.0)
        torch.testing.assert_close(sde.actions, ode.actions, atol=1e-6, rtol=0)


def test_sde_sigma_formula_and_first_step_guard():
    t = torch.tensor([1.0, 0.75, 0.5])
    sig = flow.sde_sigma(t, 0.5, t_guard=0.75)
    expected = torch.tensor([0.5 * math.sqrt(1 / 0.25), 0.5 * math.sqrt(0.75 / 0.25), 0.5 * 1.0])
    torch.testing.assert_close(sig, expected)


def test_sde_step_log_prob_equals_handwritten_gaussian():
    torch.manual_seed(1)
    v_const = torch.randn(2, 3, 4)
    x1 = torch.randn(2, 3, 4)
    out = flow.sample(lambda x, t: v_const, x1, num_steps=4, method="sde", sde_mode="all", noise_level=0.5)
    # Step 1: t = 0.75, dt = 0.25, sigma = 0.5 sqrt(0.75 / 0.25).
    t, dt = 0.75, 0.25
    sigma = 0.5 * math.sqrt(t / (1 - t))
    x_t, x_next = out.chain[:, 1], out.chain[:, 2]
    x0_hat, x1_hat = x_t - t * v_const, x_t + (1 - t) * v_const
    mean = x0_hat * (1 - (t - dt)) + x1_hat * (t - dt - sigma**2 * dt / (2 * t))
    std = sigma * math.sqrt(dt)
    by_hand = -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(out.log_probs[:, 1], by_hand, atol=1e-5, rtol=1e-5)
    ent = 0.5 * math.log(2 * math.pi * math.e * std**2)
    torch.testing.assert_close(out.entropy[:, 1], torch.full_like(by_hand, ent))
    torch.testing.assert_close(out.init_log_prob, -0.5 * x1**2 - 0.5 * math.log(2 * math.pi))


def noise_field(x, t):
    v = torch.sin(x) + t[:, None, None]
    std = 0.08 + 0.04 * torch.sigmoid(x)
    return v, std


def test_flow_noise_log_prob_uses_head_std_and_ode_mean():
    x1 = torch.randn(3, 2, 2)
    out = flow.sample(noise_field, x1, num_steps=5, method="noise")
    assert out.stochastic.all()
    x_t, x_next = out.chain[:, 2], out.chain[:, 3]
    t = torch.full((3,), 0.6)
    v, std = noise_field(x_t, t)
    mean = x_t - 0.2 * v
    by_hand = torch.distributions.Normal(mean, std).log_prob(x_next)
    torch.testing.assert_close(out.log_probs[:, 2], by_hand, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method,sde_mode", [("sde", "all"), ("sde", "mixed"), ("noise", "all")])
def test_recomputed_chain_log_prob_equals_sampling_time(method, sde_mode):
    field = noise_field if method == "noise" else gaussian_target_field(0.2, 0.8)
    x1 = torch.randn(32, 5, 3)
    out = flow.sample(field, x1, num_steps=6, method=method, sde_mode=sde_mode)
    re = flow.chain_log_prob(field, out.chain, out.stochastic, method=method)
    torch.testing.assert_close(re.log_probs, out.log_probs, atol=1e-6, rtol=0)
    torch.testing.assert_close(re.entropy, out.entropy, atol=1e-6, rtol=0)
    torch.testing.assert_close(re.init_log_prob, out.init_log_prob)
    ratio = torch.exp(flow.aggregate(re.log_probs, out.stochastic) - flow.aggregate(out.log_probs,
                                                                                     out.stochastic))
    torch.testing.assert_close(ratio, torch.ones(32), atol=1e-6, rtol=0)


def test_mixed_sde_recompute_costs_one_field_evaluation():
    calls = []

    def field(x, t):
        calls.append(x.shape[0])
        return gaussian_target_field(0.0, 1.0)(x, t)

    out = flow.sample(field, torch.randn(8, 4, 2), num_steps=10, method="sde", sde_mode="mixed")
    assert (out.stochastic.sum(1) == 1).all()
    calls.clear()
    re = flow.chain_log_prob(field, out.chain, out.stochastic, method="sde")
    assert re.field_evals == 1 and calls == [8]
    calls.clear()
    flow.chain_log_prob(noise_field, out.chain, torch.ones(8, 10, dtype=torch.bool), method="noise")
    noise_evals = flow.chain_log_prob(noise_field, out.chain, torch.ones(8, 10, dtype=torch.bool),
                                      method="noise").field_evals
    assert noise_evals == 10


def test_recompute_detects_changed_parameters():
    x1 = torch.randn(16, 4, 2)
    out = flow.sample(gaussian_target_field(0.0, 1.0), x1, num_steps=4, method="sde", sde_mode="all")
    re = flow.chain_log_prob(gaussian_target_field(0.3, 1.0), out.chain, out.stochastic, method="sde")
    assert not torch.allclose(re.log_probs, out.log_probs)


def test_aggregate_reductions_by_hand():
    lp = torch.arange(2 * 3 * 4 * 2, dtype=torch.float32).reshape(2, 3, 4, 2)
    stoch = torch.tensor([[True, False, True], [False, True, False]])
    dim_mask = torch.tensor([True, False])
    got = flow.aggregate(lp, stoch, steps="mean", actions="sum", dims="sum", executed=2, dim_mask=dim_mask)
    exp0 = (lp[0, 0, :2, 0].sum() + lp[0, 2, :2, 0].sum()) / 2
    exp1 = lp[1, 1, :2, 0].sum()
    torch.testing.assert_close(got, torch.stack([exp0, exp1]))
    total = flow.aggregate(lp, stoch, steps="sum", actions="sum", dims="sum")
    torch.testing.assert_close(total, (lp * stoch[:, :, None, None]).sum(dim=(1, 2, 3)))
    per_dim = flow.aggregate(lp, stoch, steps="mean", actions="mean", dims="none")
    assert per_dim.shape == (2, 2)
    torch.testing.assert_close(per_dim[1], lp[1, 1].mean(dim=0))
    with pytest.raises(ValueError, match="reduction"):
        flow.aggregate(lp, stoch, steps="max")


def test_seeded_sampling_is_reproducible():
    x1 = torch.randn(4, 3, 2)
    a = flow.sample(noise_field, x1, num_steps=4, method="noise", generator=torch.Generator().manual_seed(3))
    b = flow.sample(noise_field, x1, num_steps=4, method="noise", generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.chain, b.chain)


def test_bad_inputs_get_clear_errors():
    f = gaussian_target_field(0.0, 1.0)
    with pytest.raises(ValueError, match=r"\[N, H, A\]"):
        flow.sample(f, torch.randn(4, 3), num_steps=3)
    with pytest.raises(ValueError, match="NaN"):
        flow.sample(f, torch.full((1, 2, 2), float("nan")), num_steps=3)
    with pytest.raises(TypeError, match="floating"):
        flow.sample(f, torch.zeros(1, 2, 2, dtype=torch.long), num_steps=3)
    with pytest.raises(ValueError, match="unknown flow method"):
        flow.sample(f, torch.randn(1, 2, 2), num_steps=3, method="ddpm")
    with pytest.raises(ValueError, match="num_steps"):
        flow.sample(f, torch.randn(1, 2, 2), num_steps=0)
    with pytest.raises(ValueError, match=r"\(velocity, std\)"):
        flow.sample(f, torch.randn(1, 2, 2), num_steps=3, method="noise")
    with pytest.raises(ValueError, match="velocity of shape"):
        flow.sample(lambda x, t: x[:, :1], torch.randn(1, 2, 2), num_steps=3)
    with pytest.raises(ValueError, match="stochastic"):
        flow.chain_log_prob(f, torch.randn(2, 4, 2, 2), torch.ones(2, 2, dtype=torch.bool), method="sde")


@pytest.mark.parametrize("num_steps", [1, 4, 10])
def test_denoise_equals_ode_sample_bit_for_bit(num_steps):
    field = gaussian_target_field(0.7, 0.3)
    x1 = torch.randn(6, 5, 3, generator=torch.Generator().manual_seed(1))
    reference = flow.sample(field, x1, num_steps=num_steps, method="ode").actions
    assert torch.equal(flow.denoise(field, x1, num_steps=num_steps), reference)
    # A field that also returns a std (the model's training field) gives the same actions.
    assert torch.equal(flow.denoise(lambda x, t: (field(x, t), torch.ones_like(x)), x1, num_steps=num_steps),
                       reference)


def test_denoise_constant_velocity_and_bad_inputs():
    c = torch.tensor([0.3, -1.2])
    x1 = torch.randn(3, 4, 2)
    torch.testing.assert_close(flow.denoise(lambda x, t: c.expand_as(x), x1, num_steps=5), x1 - c,
                               atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"\[N, H, A\]"):
        flow.denoise(lambda x, t: x, torch.randn(4, 3), num_steps=3)
    with pytest.raises(ValueError, match="num_steps"):
        flow.denoise(lambda x, t: x, x1, num_steps=0)
    with pytest.raises(ValueError, match="velocity of shape"):
        flow.denoise(lambda x, t: x[:, :1], x1, num_steps=2)
