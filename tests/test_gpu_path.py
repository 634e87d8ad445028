"""The options that serve the pi0 preset on a GPU, checked on the CPU for what they compute: bf16 weights
(within a stated tolerance of fp32), the denoising loop's execution modes (the fallback is the eager loop bit
for bit; torch.compile equals it to 1e-5), activation checkpointing (gradients and PPO log-probs unchanged).
The CUDA-graph path itself is checked under ``pytest -m gpu``."""

import copy
import warnings

import numpy as np
import pytest
import torch
from helpers import make_obs, perturbed_model

from vla_rl.core.ranges import ConfigError
from vla_rl.core.schema import from_dict
from vla_rl.envs.builtin import ColorReachConfig, ColorReachEnv
from vla_rl.eval.bench import BenchConfig
from vla_rl.eval.evaluate import EvalConfig
from vla_rl.policies import flow, inference
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.inference import Denoiser, cast_weights, euler_steps, weight_dtype
from vla_rl.policies.layers import RMSNorm
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.policies.recompute import activation_checkpointing
from vla_rl.presets import policy_preset
from vla_rl.rl.algorithms import PPO, PPOConfig
from vla_rl.rl.learner import Learner, LearnerConfig
from vla_rl.rl.rollout import collect_rollout

PRESETS = ["tiny", "tiny_pi05"]
# bf16 weights against fp32, 4 chunks, K = 10, normalised action units (chunks of magnitude ~1): the largest / mean
# absolute difference measured 0.011 / 0.0036 (tiny) and 0.0072 / 0.0025 (tiny_pi05).
BF16_MAX, BF16_MEAN = 0.05, 0.01


# Narrow streams, two layers each: the checkpointing tests need several layers, not width.
SMALL = {"depth": 2, "vision": {"depth": 1}, "prefix": {"width": 32, "mlp_dim": 64},
         "expert": {"width": 32, "mlp_dim": 64}, "value_hidden": 32}


def small(name: str) -> FlowPolicy:
    torch.manual_seed(0)
    model = FlowPolicy(policy_preset(name, SMALL))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.fixture(autouse=True)
def fresh_warnings():
    inference._WARNED.clear()
    yield
    inference._WARNED.clear()


def prefix_and_noise(model: FlowPolicy, n: int, seed: int = 0):
    cfg, dev = model.cfg, model.device
    noise = torch.randn(n, cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(seed + 1))
    obs = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in make_obs(cfg, n, seed).items()}
    return model.encode_prefix(obs, hidden=False), noise.to(dev)


def test_denoiser_options_are_checked():
    with pytest.raises(ValueError, match="compile must be one of"):
        Denoiser(perturbed_model("tiny"), "jit")
    with pytest.raises(ValueError, match="max_graphs"):
        Denoiser(perturbed_model("tiny"), "cudagraph", max_graphs=0)
    with pytest.raises(ConfigError, match="compile"):
        from_dict(EvalConfig, {"compile": "graphs"})
    with pytest.raises(ConfigError, match="dtype"):
        from_dict(BenchConfig, {"dtype": "fp16"})


def test_more_shapes_than_max_graphs_run_eagerly():
    model = perturbed_model("tiny")
    den = Denoiser(model, "compile", max_graphs=1)
    den._compile_failed = False
    calls = []
    den._compiled = lambda prefix, ctx, x, grid: calls.append(x.shape[0]) or euler_steps(model, prefix, ctx, x, grid)
    with torch.inference_mode():
        for n in (2, 2, 3):
            prefix, noise = prefix_and_noise(model, n)
            if n == 3:
                with pytest.warns(RuntimeWarning, match="max_graphs=1"):
                    out = den(prefix, noise, num_steps=3)
            else:
                out = den(prefix, noise, num_steps=3)
            assert torch.equal(out, Denoiser(model)(prefix, noise, num_steps=3))
    assert calls == [2, 2]   # the third shape ran the eager loop


def test_cast_weights_keeps_the_norm_scales_in_float32():
    model = perturbed_model("tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cast_weights(model, "bf16")
    assert weight_dtype(model) == "bf16"
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            want = torch.float32 if isinstance(module, RMSNorm) else torch.bfloat16
            assert p.dtype == want, f"{name}.{pname}"
    cast_weights(model, "fp32")   # back: every weight is the bf16 rounding of the original
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32
        assert torch.equal(v, before[k].to(torch.bfloat16).float()) or torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="weight dtype"):
        cast_weights(model, "fp16")


@pytest.mark.parametrize("name", PRESETS)
def test_bf16_weights_give_the_fp32_chunk_within_tolerance(name):
    model = perturbed_model(name)
    low = cast_weights(copy.deepcopy(model), "bf16")
    with torch.inference_mode():
        full = Denoiser(model)(*prefix_and_noise(model, 4), num_steps=10)
        half = Denoiser(low)(*prefix_and_noise(low, 4), num_steps=10)
    assert full.dtype == half.dtype == torch.float32   # the Euler iterate stays float32
    diff = (full - half).abs()
    assert 0 < diff.max().item() <= BF16_MAX and diff.mean().item() <= BF16_MEAN


@pytest.mark.parametrize("name", PRESETS)
def test_euler_steps_are_flow_denoise_bit_for_bit(name):
    model = perturbed_model(name)
    with torch.inference_mode():
        prefix, noise = prefix_and_noise(model, 3)
        reference = flow.denoise(model.velocity_field(prefix), noise, num_steps=5)
        ctx = model.sampling_context(prefix)
        again = euler_steps(model, prefix, ctx, noise.float(), flow.time_grid(5))
    assert torch.equal(again, reference)


@pytest.mark.parametrize("mode", ["cudagraph", "compile"])
def test_fallbacks_are_the_eager_loop_bit_for_bit(mode, monkeypatch):
    """cudagraph on a CPU, a torch.compile that fails, and either under autograd: one warning, then eager."""
    model = perturbed_model("tiny")
    if mode == "compile":
        def broken(*args, **kwargs):
            raise RuntimeError("no compiler here")
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    den = Denoiser(model, mode)
    with torch.inference_mode():
        prefix, noise = prefix_and_noise(model, 2)
        reference = Denoiser(model)(prefix, noise, num_steps=4)
        with pytest.warns(RuntimeWarning, match="eagerly"):
            first = den(prefix, noise, num_steps=4)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*eagerly")   # said once only
            second = den(prefix, noise, num_steps=4)
    assert torch.equal(first, reference) and torch.equal(second, reference)
    with pytest.warns(RuntimeWarning, match="without autograd"):
        graded = den(*prefix_and_noise(model, 2), num_steps=4)
    assert torch.allclose(graded, reference, atol=1e-6, rtol=0)


def test_actor_chunk_with_a_fallback_mode_equals_act():
    model = perturbed_model("tiny")
    g = torch.Generator().manual_seed(0)
    norm = NormStats(Stats.of(torch.randn(32, model.cfg.state_dim, generator=g)),
                     Stats.of(torch.randn(32, model.cfg.action_dim, generator=g)))
    obs = make_obs(model.cfg, 3)
    sampler = SamplerConfig(6, "ode")
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match="CUDA"):
        fast = Actor(model, norm, compile="cudagraph").chunk(obs, sampler, generator=torch.Generator().manual_seed(5))
        plain = Actor(model, norm)
        reference = plain.act(plain.observe(obs), sampler, generator=torch.Generator().manual_seed(5)).actions
    assert torch.equal(fast, reference)


@pytest.mark.slow   # torch.compile with the C++ backend: ~90 s for the tiny preset on 2 shared cores
def test_torch_compile_equals_eager():
    model = perturbed_model("tiny")
    den = Denoiser(model, "compile")
    with torch.inference_mode():
        for seed in (0, 1):   # a second prefix of the same shape reuses the compiled loop
            prefix, noise = prefix_and_noise(model, 2, seed)
            reference = Denoiser(model)(prefix, noise, num_steps=4)
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*eagerly")   # no fallback
                out = den(prefix, noise, num_steps=4)
            assert (out - reference).abs().max().item() <= 1e-5


# ------------------------------------------------------------------------------------------------------
# Activation checkpointing
# ------------------------------------------------------------------------------------------------------
def ppo_like_loss(model: FlowPolicy, obs: dict, method: str):
    """A Flow-Noise / mixed Flow-SDE chain's recomputed log-likelihood plus the value, as the learner's loss."""
    cfg = model.cfg
    with torch.no_grad():
        s = flow.sample(model.field(model.encode_prefix(obs)), torch.randn(len(obs["state"]), cfg.action_horizon,
                        cfg.action_dim, generator=torch.Generator().manual_seed(3)), num_steps=4, method=method,
                        generator=torch.Generator().manual_seed(4))
    prefix = model.encode_prefix(obs)
    lp = flow.chain_log_prob(model.field(prefix), s.chain, s.stochastic, method=method)
    agg = flow.aggregate(lp.log_probs, s.stochastic)
    return agg, agg.mean() + model.value(prefix).pow(2).mean()


@pytest.mark.parametrize("name, method, parts", [("tiny", "noise", "all"), ("tiny_pi05", "sde", "prefix"),
                                                 ("tiny", "sde", "expert")])
def test_checkpointed_gradients_and_log_probs_equal_the_plain_ones(name, method, parts):
    model = small(name).train()
    obs = make_obs(model.cfg, 3)
    lp_plain, loss = ppo_like_loss(model, obs, method)
    loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with activation_checkpointing(model, parts):
        assert "finish" in (model.prefix_layers[0] if parts != "expert" else model.expert_layers[0]).__dict__
        lp_ckpt, loss = ppo_like_loss(model, obs, method)
        loss.backward()
    assert not any("finish" in layer.__dict__ for layer in [*model.prefix_layers, *model.expert_layers])
    assert torch.equal(lp_ckpt, lp_plain)   # the log-probs PPO's ratio reads are unchanged
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == plain.keys()
    for n in plain:
        assert (got[n] - plain[n]).abs().max().item() <= 1e-6, n


def test_activation_checkpointing_refuses_unknown_parts():
    with pytest.raises(ValueError, match="one of"), activation_checkpointing(small("tiny"), "vision"):
        pass
    with pytest.raises(ConfigError, match="grad_checkpointing"):
        from_dict(LearnerConfig, {"grad_checkpointing": "layers"})


def test_learner_with_checkpointing_takes_the_same_step():
    torch.manual_seed(0)
    env = ColorReachEnv(4, config=ColorReachConfig(max_episode_steps=6), seed=0)
    norm = NormStats(Stats.identity(4), Stats.identity(2))
    model = small("tiny")
    actor = Actor(model, norm, env_state_dim=4, env_action_dim=2)
    ro, _ = collect_rollout(actor, env, env.reset(seed=1), num_chunks=2, sampler=SamplerConfig(3, "noise"),
                            execute=4, generator=torch.Generator().manual_seed(0))
    results = []
    for parts in ("none", "all"):
        cfg = LearnerConfig(update_epochs=1, minibatches=2, lr_actor=1e-3, grad_checkpointing=parts)
        learner = Learner(Actor(copy.deepcopy(model), norm, env_state_dim=4, env_action_dim=2), cfg, PPO(PPOConfig()))
        results.append((learner.update(ro, iteration=0), dict(learner.actor.model.named_parameters())))
    (m0, p0), (m1, p1) = results
    for k in ("losses/policy", "losses/value", "losses/approx_kl"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-6, abs=1e-9), k
    with torch.no_grad():
        for n in p0:
            assert (p0[n] - p1[n]).abs().max().item() <= 1e-6, n


# ------------------------------------------------------------------------------------------------------
# CUDA
# ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("mode", ["cudagraph", "compile"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_graphed_and_compiled_loops_equal_eager_on_cuda(name, mode, dtype):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = cast_weights(perturbed_model(name).cuda(), dtype)
        den = Denoiser(model, mode)
        tol = 1e-5 if dtype == "fp32" else 2e-2   # bf16: another kernel choice may round differently
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*eagerly")   # no fallback on a GPU
            for seed in (0, 1, 2):   # new prefixes through the same graph: its static buffers are refreshed
                prefix, noise = prefix_and_noise(model, 3, seed)
                reference = Denoiser(model)(prefix, noise, num_steps=10)
                out = den(prefix, noise, num_steps=10)
                assert out.device.type == "cuda"
                assert (out - reference).abs().max().item() <= tol
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_actor_chunk_through_a_cuda_graph_equals_act():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = perturbed_model("tiny").cuda()
        norm = NormStats(Stats.identity(model.cfg.state_dim), Stats.identity(model.cfg.action_dim))
        obs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in make_obs(model.cfg, 4).items()}
        sampler = SamplerConfig(10, "ode")
        graphed, plain = Actor(model, norm, compile="cudagraph"), Actor(model, norm)
        with torch.inference_mode():
            for seed in (0, 1):
                fast = graphed.chunk(obs, sampler, generator=torch.Generator("cuda").manual_seed(seed))
                reference = plain.act(plain.observe(obs), sampler,
                                      generator=torch.Generator("cuda").manual_seed(seed)).actions
                assert (fast - reference).abs().max().item() <= 1e-5
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_learner_with_checkpointing_under_bf16_autocast_on_cuda():
    torch.manual_seed(0)
    env = ColorReachEnv(8, config=ColorReachConfig(max_episode_steps=6), device="cuda", seed=0)
    norm = NormStats(Stats.identity(4), Stats.identity(2))
    model = small("tiny").cuda()
    actor = Actor(model, norm, env_state_dim=4, env_action_dim=2)
    ro, _ = collect_rollout(actor, env, env.reset(seed=1), num_chunks=2, sampler=SamplerConfig(4, "noise"),
                            execute=4, generator=torch.Generator("cuda").manual_seed(0))
    metrics = []
    for parts in ("none", "all"):
        cfg = LearnerConfig(update_epochs=1, minibatches=2, grad_checkpointing=parts)
        learner = Learner(Actor(copy.deepcopy(model), norm, env_state_dim=4, env_action_dim=2), cfg, PPO(PPOConfig()),
                          bf16=True)
        assert learner.autocast
        metrics.append(learner.update(ro, iteration=0))
    for k in ("losses/policy", "losses/value", "losses/approx_kl"):
        assert torch.isfinite(torch.tensor(metrics[1][k])), k
        assert metrics[1][k] == pytest.approx(metrics[0][k], rel=1e-3, abs=1e-5), k


def test_eval_takes_dtype_and_compile(tmp_path):
    """`vla-rl eval ... dtype=bf16 compile=cudagraph`: on a CPU the loop falls back (a warning) and evaluates
    the same episodes as the default; bf16 weights evaluate too."""
    from vla_rl.checkpoint.policy import save_policy
    from vla_rl.data.collect import collect_builtin_demos
    from vla_rl.eval.evaluate import evaluate_checkpoint

    torch.manual_seed(0)
    data = collect_builtin_demos(2, seed=0)
    path = save_policy(tmp_path / "policy", FlowPolicy(policy_preset("tiny", SMALL)),
                       NormStats(Stats.of(data.state), Stats.of(data.action)))
    settings = {"episodes": 4, "num_envs": 4, "progress": False, "env": {"builtin": {"max_episode_steps": 8}}}
    log = lambda *_: None  # noqa: E731
    reference = evaluate_checkpoint(path, settings, log=log)
    with pytest.warns(RuntimeWarning, match="CUDA"):
        graphed = evaluate_checkpoint(path, {**settings, "compile": "cudagraph"}, log=log)
    assert graphed == reference
    low = evaluate_checkpoint(path, {**settings, "dtype": "bf16"}, log=log)
    assert low.keys() == reference.keys() and all(v == v for v in low.values())


def test_exported_policy_with_a_loop_mode_acts_as_the_default(tmp_path):
    """`load_exported(..., compile=...)` (`vla-rl serve --compile`): the same chunk as the default loop on a
    CPU (cudagraph falls back); bf16 compute keeps the RMSNorm scales in fp32."""
    from exported_fixture import observation, policy_folder

    from vla_rl.interop.export import export_policy
    from vla_rl.policies import load_exported

    src = policy_folder(tmp_path / "policy", overrides=SMALL)[0]
    out = export_policy(src, tmp_path / "export", dtype="bf16")
    reference = load_exported(out).infer(observation(), seed=3)
    graphed = load_exported(out, compile="cudagraph")
    with pytest.warns(RuntimeWarning, match="CUDA"):
        assert np.array_equal(graphed.infer(observation(), seed=3), reference)
    low = load_exported(out, dtype="bf16")
    assert low.compute_dtype == "bf16" and low.model.prefix_norm.weight.dtype == torch.float32
    assert np.abs(low.infer(observation(), seed=3) - reference).max() < 0.1
