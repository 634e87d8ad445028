"""The CUDA path: the same code as on CPU, with the device as configuration (``pytest -m gpu``).

What must hold on a GPU: the policy computes what it computes on the CPU; the cached sampler equals the
uncached joint pass; a recomputed chain log-likelihood equals the sampling-time one; the built-in env runs
on the GPU and passes the env contract; and the trainer runs end to end (fp32 and bf16 autocast) with
observations, rollouts and updates never leaving the device.
"""

import pytest
import torch
from contract import check_env_contract
from helpers import make_obs, perturbed_model, train_config

from vla_rl.envs.builtin import ColorReachEnv
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.rl.rollout import collect_rollout
from vla_rl.train.trainer import Trainer, resume_trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def exact_fp32():
    # TF32 matmuls would make a CPU/GPU comparison a test of TF32, not of our code.
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def to(obs: dict, device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in obs.items()}


@pytest.mark.parametrize("name", ["tiny", "tiny_pi05"])
def test_policy_on_cuda_matches_cpu(name):
    cpu = perturbed_model(name)
    gpu = perturbed_model(name).cuda()
    cfg = cpu.cfg
    obs = make_obs(cfg, 6)
    x_t = torch.randn(6, cfg.action_horizon, cfg.action_dim)
    t = torch.rand(6)
    with torch.no_grad():
        a = cpu.expert(cpu.encode_prefix(obs), x_t, t)
        b = gpu.expert(gpu.encode_prefix(to(obs, "cuda")), x_t.cuda(), t.cuda())
    for x, y in [(a.velocity, b.velocity), (a.noise_std, b.noise_std), (a.value, b.value)]:
        assert y.device.type == "cuda"
        assert (x - y.cpu()).abs().max().item() <= 1e-4


def test_cached_equals_uncached_on_cuda():
    model = perturbed_model("tiny").cuda()
    cfg = model.cfg
    obs = to(make_obs(cfg, 5), "cuda")
    x_t = torch.randn(5, cfg.action_horizon, cfg.action_dim, device="cuda")
    t = torch.rand(5, device="cuda")
    with torch.no_grad():
        cached = model.expert(model.encode_prefix(obs), x_t, t)
        _, joint = model.forward_joint(obs, x_t, t)
    assert (cached.velocity - joint.velocity).abs().max().item() <= 1e-5


@pytest.mark.parametrize("method", ["noise", "sde"])
def test_recomputed_log_prob_equals_sampling_time_on_cuda(method):
    model = perturbed_model("tiny").cuda()
    cfg = model.cfg
    obs = to(make_obs(cfg, 8), "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        prefix = model.encode_prefix(obs)
        noise = torch.randn(8, cfg.action_horizon, cfg.action_dim, device="cuda", generator=gen)
        s = flow.sample(model.field(prefix), noise, num_steps=4, method=method, noise_level=0.5,
                        sde_mode="mixed", generator=gen)
        again = flow.chain_log_prob(model.field(prefix), s.chain, s.stochastic, method=method, noise_level=0.5)
    assert s.actions.device.type == "cuda"
    assert (s.log_probs - again.log_probs).abs().max().item() <= 1e-4
    assert s.stochastic.any()  # some step was stochastic, so the comparison is not of zeros


def test_builtin_env_on_cuda_passes_the_contract():
    env = ColorReachEnv(16, device="cuda", seed=0)
    check_env_contract(env, horizon=8)
    obs = env.reset(seed=0)
    assert obs["images"].device.type == "cuda" and obs["state"].device.type == "cuda"


def test_rollout_stays_on_the_device(sft_checkpoint):
    from vla_rl.checkpoint.policy import load_policy

    model, norm, _ = load_policy(sft_checkpoint, device="cuda")
    env = ColorReachEnv(8, device="cuda", seed=0)
    actor = Actor(model, norm)
    ro, _ = collect_rollout(actor, env, env.reset(seed=0), num_chunks=2, sampler=SamplerConfig(4, "noise"),
                            execute=8, generator=torch.Generator("cuda").manual_seed(0))
    for name in ("rewards", "values", "log_probs", "chain", "final_values", "last_values"):
        assert getattr(ro, name).device.type == "cuda", name
    for name, value in ro.obs.items():
        assert value.device.type == "cuda", name


@pytest.mark.parametrize("bf16", [False, True])
def test_trainer_runs_and_resumes_on_cuda(sft_checkpoint, tmp_path, bf16):
    out = tmp_path / "run"
    trainer = Trainer(train_config(sft_checkpoint, out, device="cuda", bf16=bf16))
    history = trainer.run()
    assert trainer.env.reset(seed=0)["state"].device.type == "cuda"
    last = history[-1]
    assert last["iteration"] == 2
    for key in ("losses/policy", "losses/value", "losses/approx_kl", "eval/success_once"):
        assert torch.isfinite(torch.tensor(last[key])), key
    assert last["time/peak_memory_mb"] > 0
    more = resume_trainer(out, overrides={"iterations": 3}, log=lambda *_: None)
    assert more.iteration == 2
    assert more.run()[-1]["iteration"] == 3
