"""LeRobot π0 / π0.5 checkpoints through our one model: tiny fixtures written by LeRobot 0.4.4, 0.5.1 and 0.6.1
(scripts/fixtures/lerobot_pi_fixtures.py) reproduce its own ``sample_actions`` and, from raw robot-unit inputs, its
processors + policy; masks, cache, real-size parameter counts and refusals of checkpoints we do not understand."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vla_rl.checkpoint.lerobot import is_lerobot_folder, load_lerobot
from vla_rl.checkpoint.lerobot_format import LeRobotImportError, read_norm_stats
from vla_rl.cli import main as cli_main
from vla_rl.policies import flow
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.model import FlowPolicy, count_parameters
from vla_rl.presets import policy_preset

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_pi_tiny"
GENERATIONS = ["lerobot-0.4.4", "lerobot-0.5.1", "lerobot-0.6.1"]   # tied embedding; untied (+ relative actions)
FIXTURES = ROOT / "lerobot-0.4.4"   # the mechanics below (masks, cache, refusals) on the first generation
KINDS = ["pi0", "pi05"]
# What the weights cannot tell: the tiny SigLIP's head count (reference_meta.json records it).
TINY = {"vision": {"num_heads": 2}}
EVERY = [(g, k) for g in GENERATIONS for k in KINDS]
PIPELINES = [(g, k) for g in GENERATIONS[1:] for k in KINDS]   # the fixtures with a raw-input reference


def fixture(kind: str, generation: str = "lerobot-0.4.4") -> tuple[FlowPolicy, dict]:
    model, _, _ = load_lerobot(ROOT / generation / kind, overrides=TINY)
    return model, load_file(str(ROOT / generation / kind / "reference.safetensors"))


def reference_obs(ref: dict) -> dict:
    """The reference's inputs as our observation: images [N, C, H, W, 3] already in [-1, 1]."""
    images = torch.stack([ref["img0"], ref["img1"]], dim=1).permute(0, 1, 3, 4, 2)
    return {"images": images, "image_mask": ref["img_masks"], "state": ref["state"], "tokens": ref["lang_tokens"],
            "token_mask": ref["lang_masks"]}


def actions(model: FlowPolicy, obs: dict, noise: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return flow.sample(model.field(model.encode_prefix(obs)), noise, num_steps=5, method="ode").actions


@pytest.mark.parametrize("generation, kind", EVERY)
def test_fixture_reproduces_lerobot_sample_actions(generation, kind):
    model, ref = fixture(kind, generation)
    err = (actions(model, reference_obs(ref), ref["noise"]) - ref["actions"]).abs().max().item()
    assert err <= 1e-5, err   # measured <= 5e-7 on every generation


@pytest.mark.parametrize("generation, kind", PIPELINES)
def test_raw_inputs_reproduce_lerobot_processors_and_policy(generation, kind):
    """Robot-unit state, uint8 camera frames of another size and task strings through our actor (normalisation,
    resize-with-pad, prompt and tokenizer, unnormalisation) give the actions LeRobot's pre-processor,
    ``predict_action_chunk`` and post-processor give, for the same initial noise."""
    folder = ROOT / generation / kind
    model, norm, _ = load_lerobot(folder, overrides=TINY)   # finds folder/tokenizer.model
    ref = load_file(str(folder / "reference.safetensors"))
    tasks = json.loads((folder / "reference_meta.json").read_text())["tasks"]
    obs = {"images": torch.stack([ref["raw_img0"], ref["raw_img1"]], dim=1).permute(0, 1, 3, 4, 2),
           "state": ref["raw_state"], "instruction": tasks}
    actor = Actor(model, norm, action_low=-float("inf"), action_high=float("inf"))   # LeRobot does not clip
    prepared = model.prepare(actor.model_obs(obs))
    assert torch.equal(prepared["tokens"], ref["pipeline_tokens"])
    assert torch.equal(prepared["token_mask"].bool(), ref["pipeline_token_mask"].bool())
    noise = ref["noise"]
    draws = flow.SampleNoise(noise, torch.zeros(2, 5, dtype=torch.bool), torch.zeros(5, *noise.shape))
    got = actor.chunk(obs, SamplerConfig(num_steps=5, method="ode"), draws=draws)
    err = (got - ref["pipeline_actions"]).abs().max().item()
    assert err <= 1e-4, err   # measured <= 1e-6


def test_current_lerobot_embeds_with_embed_tokens_not_lm_head():
    """LeRobot >= 0.5 stores PaliGemma's lm_head and embed_tokens as two tensors and embeds with the latter;
    0.4 stored one of the tied pair. Embedding with the other table moves π0's actions by ~0.4 on the fixture."""
    folder = ROOT / "lerobot-0.6.1" / "pi0"
    pg = "model.paligemma_with_expert.paligemma."
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        embed, head = f.get_tensor(pg + "model.language_model.embed_tokens.weight"), f.get_tensor(pg + "lm_head.weight")
    assert not torch.equal(embed, head)
    model, _ = fixture("pi0", "lerobot-0.6.1")
    assert torch.equal(model.text_embed.weight, embed)


@pytest.mark.parametrize("generation", GENERATIONS[1:])
def test_relative_action_checkpoints_are_refused_and_nothing_is_written(generation, tmp_path, capsys):
    """A checkpoint trained with ``use_relative_actions`` predicts offsets from the state; imported as absolute
    it would act wrongly without an error, so it is refused in one line (0.5 names its step delta_actions)."""
    src = ROOT / generation / "pi05_relative"
    with pytest.raises(LeRobotImportError, match="trained with relative actions.*refuses"):
        load_lerobot(src, overrides=TINY)
    out = tmp_path / "out"
    assert cli_main(["import", "lerobot", str(src), str(out), "vision.num_heads=2"]) == 2
    err = capsys.readouterr().err
    assert "relative actions" in err and not out.exists()
    # The flag alone (processors without the step) and the step alone (a config without the flag) are enough.
    for edit in ("config", "processor"):
        folder = tmp_path / edit
        shutil.copytree(src, folder)
        if edit == "config":
            for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
                pipe = json.loads((folder / name).read_text())
                pipe["steps"] = [s for s in pipe["steps"] if "actions_processor" not in s["registry_name"]]
                (folder / name).write_text(json.dumps(pipe))
        else:
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**cfg, "use_relative_actions": False}))
        with pytest.raises(LeRobotImportError, match="trained with relative actions"):
            load_lerobot(folder, overrides=TINY)


def test_processor_steps_we_do_not_reproduce_are_refused(tmp_path):
    folder = tmp_path / "pi05"
    shutil.copytree(ROOT / "lerobot-0.6.1" / "pi05", folder)
    load_lerobot(folder, overrides=TINY)   # disabled relative / absolute steps are fine
    pipe = json.loads((folder / "policy_postprocessor.json").read_text())
    pipe["steps"].insert(1, {"registry_name": "action_smoothing_processor", "config": {}})
    (folder / "policy_postprocessor.json").write_text(json.dumps(pipe))
    with pytest.raises(LeRobotImportError, match=r"\['action_smoothing_processor'\] are not ones this importer"):
        load_lerobot(folder, overrides=TINY)
    (folder / "policy_postprocessor.json").write_text("{}")
    with pytest.raises(LeRobotImportError, match="not a LeRobot processor pipeline"):
        load_lerobot(folder, overrides=TINY)


def test_fixture_dims_and_options_are_inferred():
    for generation in GENERATIONS:
        meta = json.loads((ROOT / generation / "pi0" / "reference_meta.json").read_text())["tiny_dims"]
        for kind in KINDS:
            cfg = fixture(kind, generation)[0].cfg
            assert (cfg.prefix.width, cfg.expert.width, cfg.depth, cfg.num_heads, cfg.head_dim, cfg.vocab_size) == (
                meta["vlm"]["width"], meta["expert"]["width"], meta["vlm"]["depth"], meta["num_heads"],
                meta["head_dim"], meta["vocab_size"])
            assert (cfg.vision.width, cfg.vision.depth, cfg.vision.mlp_dim, cfg.vision.image_size) == (
                meta["siglip"]["width"], meta["siglip"]["depth"], meta["siglip"]["mlp_dim"],
                meta["siglip"]["image_size"])
            assert (cfg.action_horizon, cfg.action_dim, cfg.max_text_tokens, cfg.num_cameras) == (
                6, 8, meta["tokenizer_max_length"], 2)
            assert cfg.camera_names == ("observation.images.cam0", "observation.images.cam1")
            assert cfg.state_input == ("prompt" if kind == "pi05" else "suffix")
            assert cfg.adarms_final_norm == (kind == "pi05")
            assert cfg.image_resize == "pad" and not cfg.image_antialias   # LeRobot's resize_with_pad_torch


@pytest.mark.parametrize("kind", KINDS)
def test_masked_camera_is_left_out_and_unmasking_it_matters(kind):
    model, ref = fixture(kind)
    obs = reference_obs(ref)
    base = actions(model, obs, ref["noise"])
    masked = ~obs["image_mask"]
    assert masked.sum() == 1 and masked[1, 1]   # the second sample's second camera
    other = obs["images"].clone()
    other[1, 1] = -other[1, 1].flip(1)          # different pixels, still in [-1, 1]
    torch.testing.assert_close(actions(model, {**obs, "images": other}, ref["noise"]), base, atol=1e-6, rtol=0)
    # A policy given only its first camera masks the second slot (π0's empty camera): the same for sample 1.
    fewer = {**obs, "images": obs["images"][:, :1], "image_mask": None}
    torch.testing.assert_close(actions(model, fewer, ref["noise"])[1], base[1], atol=1e-6, rtol=0)
    unmasked = actions(model, {**obs, "image_mask": torch.ones_like(obs["image_mask"])}, ref["noise"])
    assert (unmasked[1] - base[1]).abs().max() > 1e-4   # a random tiny model: small but far above 1e-6
    torch.testing.assert_close(unmasked[0], base[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_text_is_left_out(kind):
    model, ref = fixture(kind)
    obs = reference_obs(ref)
    tokens = obs["tokens"].clone()
    tokens[~obs["token_mask"]] = 5
    assert (~obs["token_mask"]).sum() == 3
    torch.testing.assert_close(actions(model, {**obs, "tokens": tokens}, ref["noise"]),
                               actions(model, obs, ref["noise"]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_expert_equals_joint_pass(kind):
    model, ref = fixture(kind)
    obs = reference_obs(ref)
    x, t = torch.randn(2, 6, 8), torch.tensor([0.3, 0.9])
    with torch.no_grad():
        cached = model.expert(model.encode_prefix(obs), x, t)
        hidden, joint = model.forward_joint(obs, x, t)
    torch.testing.assert_close(cached.velocity, joint.velocity, atol=1e-5, rtol=0)
    torch.testing.assert_close(cached.value, joint.value, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_new_heads_start_neutral(kind):
    model, ref = fixture(kind)
    cfg = model.cfg
    with torch.no_grad():
        out = model.expert(model.encode_prefix(reference_obs(ref)), torch.randn(2, 6, 8), torch.rand(2))
    middle = (cfg.noise_std_min * cfg.noise_std_max) ** 0.5
    torch.testing.assert_close(out.noise_std, torch.full_like(out.noise_std, middle))
    assert torch.equal(out.value, torch.zeros(2))


@pytest.mark.parametrize("name, lerobot, lm_head", [("pi0", 3_238_048_528, 257_152 * 1024),
                                                    ("pi05", 3_353_433_872, 257_152 * 1024)])
def test_real_presets_have_lerobot_parameter_counts(name, lerobot, lm_head):
    """LeRobot's PI0Policy / PI05Policy (3 cameras at 224, 32-dim state / action) count 3,501,372,176 /
    3,616,757,520 parameters with the expert's unused lm_head; ours has no lm_head but a Flow-Noise and a value head."""
    with torch.device("meta"):
        model = FlowPolicy(policy_preset(name))
    rl_heads = count_parameters(model.noise_head) + count_parameters(model.value_head)
    assert count_parameters(model) - rl_heads == lerobot
    assert lerobot + lm_head == {"pi0": 3_501_372_176, "pi05": 3_616_757_520}[name]


def test_bf16_checkpoint_gives_the_same_actions_to_bf16_tolerance(tmp_path):
    for kind in KINDS:
        folder = tmp_path / kind
        shutil.copytree(FIXTURES / kind, folder)
        tensors = load_file(str(folder / "model.safetensors"))
        save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(folder / "model.safetensors"))
        model, _, _ = load_lerobot(folder, overrides=TINY)
        assert model.velocity_head.weight.dtype == torch.float32
        ref = load_file(str(FIXTURES / kind / "reference.safetensors"))
        err = (actions(model, reference_obs(ref), ref["noise"]) - ref["actions"]).abs().max().item()
        assert err < 0.05, (kind, err)   # bf16 weights: ~3 significant digits
        kept, _, _ = load_lerobot(folder, overrides=TINY, dtype=torch.bfloat16)
        assert kept.velocity_head.weight.dtype == torch.bfloat16


def _rewrite(folder: Path, edit) -> None:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_checkpoints_we_do_not_understand_are_refused_by_name(tmp_path):
    folder = tmp_path / "pi0"
    shutil.copytree(FIXTURES / "pi0", folder)
    _rewrite(folder, lambda t: t.pop("model.state_proj.bias"))
    with pytest.raises(LeRobotImportError, match=r"missing 1 tensor\(s\): model.state_proj.bias"):
        load_lerobot(folder, overrides=TINY)
    shutil.copy(FIXTURES / "pi0" / "model.safetensors", folder / "model.safetensors")
    _rewrite(folder, lambda t: t.update({"model.extra_head.weight": torch.zeros(3)}))
    with pytest.raises(LeRobotImportError, match="does not understand: model.extra_head.weight"):
        load_lerobot(folder, overrides=TINY)
    shutil.copy(FIXTURES / "pi0" / "model.safetensors", folder / "model.safetensors")
    key = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.up_proj.weight"
    _rewrite(folder, lambda t: t.update({key: torch.zeros(100, 32)}))
    with pytest.raises(LeRobotImportError, match=f"{key} has shape \\(100, 32\\)"):
        load_lerobot(folder, overrides=TINY)
    shutil.copy(FIXTURES / "pi0" / "model.safetensors", folder / "model.safetensors")
    _rewrite(folder, lambda t: t["model.action_in_proj.weight"].fill_(float("nan")))
    with pytest.raises(LeRobotImportError, match="action_in_proj.weight holds NaN"):
        load_lerobot(folder, overrides=TINY)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LeRobotImportError, match="corrupt safetensors"):
        load_lerobot(folder, overrides=TINY)
    (folder / "model.safetensors").unlink()
    with pytest.raises(LeRobotImportError, match="checkpoint file missing"):
        load_lerobot(folder, overrides=TINY)


def test_unknown_type_missing_heads_override_and_missing_processor_are_errors(tmp_path):
    folder = tmp_path / "pi0"
    shutil.copytree(FIXTURES / "pi0", folder)
    with pytest.raises(LeRobotImportError, match="SigLIP width 32 has no known head count.*vision.num_heads"):
        load_lerobot(folder)
    (folder / "policy_preprocessor.json").unlink()
    with pytest.raises(LeRobotImportError, match="no policy_preprocessor.json"):
        load_lerobot(folder, overrides=TINY)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "type": "xvla"}))
    assert not is_lerobot_folder(folder)
    with pytest.raises(LeRobotImportError, match="'xvla' is not one this importer understands"):
        load_lerobot(folder, overrides=TINY)


def test_normalisation_statistics_become_ours():
    for kind in KINDS:
        lr = json.loads((FIXTURES / kind / "config.json").read_text())
        norm, modes = read_norm_stats(FIXTURES / kind, lr)
        step = "5" if kind == "pi0" else "2"
        pre = load_file(str(FIXTURES / kind / f"policy_preprocessor_step_{step}_normalizer_processor.safetensors"))
        post = load_file(str(FIXTURES / kind / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"))
        x = torch.randn(5, 8)
        # The fixtures carry mean / std only (π0.5's QUANTILES mode has no quantiles there: read as mean / std).
        want = (x - pre["observation.state.mean"]) / pre["observation.state.std"]
        torch.testing.assert_close(norm.normalize_state(x), want)
        torch.testing.assert_close(norm.action.unnormalize(x, norm.mode), x * post["action.std"] + post["action.mean"])
        assert modes["state"].startswith("MEAN_STD")


@pytest.mark.parametrize("generation, written", [("lerobot-0.4.4", 32), ("lerobot-0.6.1", 8)])
def test_pi05_prompt_writes_the_state_dims_its_lerobot_wrote(generation, written, tmp_path):
    """LeRobot 0.4 discretises the state padded to max_state_dim into π0.5's prompt, LeRobot >= 0.5 the robot's own
    dims (lerobot/policies/pi05/processor_pi05.py at v0.4.4 / v0.5.1): a robot with 8 dims and max_state_dim 32."""
    folder = tmp_path / "pi05"
    shutil.copytree(ROOT / generation / "pi05", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["max_state_dim"] = 32
    cfg["input_features"]["observation.state"]["shape"] = [8]
    (folder / "config.json").write_text(json.dumps(cfg))
    model, _, _ = load_lerobot(folder, overrides=TINY)
    assert model.cfg.state_dim == 32
    prompt = model.prompts(["pick"], torch.zeros(1, 32))[0]
    assert len(prompt.split("State: ")[1].split(";")[0].split()) == written


def test_empty_cameras_listed_in_input_features_count_once(tmp_path):
    """LeRobot's config validation adds observation.images.empty_camera_i to input_features; a saved config.json may
    list them besides empty_cameras."""
    folder = tmp_path / "pi0"
    shutil.copytree(FIXTURES / "pi0", folder)
    cfg = json.loads((folder / "config.json").read_text())
    before = len([f for f in cfg["input_features"].values() if f.get("type") == "VISUAL"])
    cfg["empty_cameras"] = 1
    cfg["input_features"]["observation.images.empty_camera_0"] = {"type": "VISUAL", "shape": [3, 224, 224]}
    (folder / "config.json").write_text(json.dumps(cfg))
    model, _, _ = load_lerobot(folder, overrides=TINY)
    assert model.cfg.num_cameras == before + 1 and model.cfg.camera_names[-1] == "empty_camera_0"


def test_the_camera_resolution_it_was_trained_on_travels(tmp_path):
    """LeRobot's LIBERO checkpoints were trained on 256 px frames (input_features) for a 224 px encoder: the imported
    policy asks a LIBERO env for 256 px frames and resizes them itself, as LeRobot's pipeline does."""
    from vla_rl.envs.libero.settings import libero_env_config

    folder = tmp_path / "pi05"
    shutil.copytree(ROOT / "lerobot-0.6.1" / "pi05", folder)
    cfg = json.loads((folder / "config.json").read_text())
    for f in cfg["input_features"].values():
        if f["type"] == "VISUAL":
            f["shape"] = [3, 256, 256]
    (folder / "config.json").write_text(json.dumps(cfg))
    model, _, config = load_lerobot(folder, overrides=TINY)
    assert config["deploy"]["image_size"] == 256 and model.cfg.vision.image_size != 256
    assert libero_env_config(config, model.cfg, {}, None).image_size == 256
    _, _, plain = load_lerobot(ROOT / "lerobot-0.6.1" / "pi05", overrides=TINY)   # trained at the encoder's size
    assert "image_size" not in plain["deploy"]


def test_how_lerobot_runs_it_travels(tmp_path):
    """LeRobot's denoising steps and the actions ``select_action`` runs per chunk become the imported policy's
    deploy defaults (bench / eval / export read them); a queue as long as the chunk adds no execute."""
    folder = tmp_path / "pi05"
    shutil.copytree(ROOT / "lerobot-0.6.1" / "pi05", folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["n_action_steps"] == cfg["chunk_size"]
    _, _, config = load_lerobot(folder, overrides=TINY)
    assert config["deploy"] == {"sampler": {"num_steps": cfg["num_inference_steps"]}}
    cfg["n_action_steps"] = 4
    (folder / "config.json").write_text(json.dumps(cfg))
    _, _, config = load_lerobot(folder, overrides=TINY)
    assert config["deploy"] == {"sampler": {"num_steps": cfg["num_inference_steps"]}, "execute": 4}
