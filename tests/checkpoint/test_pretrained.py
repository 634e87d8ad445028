"""From a LeRobot π0 / π0.5 folder to our pipeline: the SentencePiece tokenizer and the prompts LeRobot's processors
build, `vla-rl import lerobot`, the imported folder through save / load / export, and an imported tiny π0 through
SFT, PPO (Flow-Noise and Flow-SDE) and `vla-rl eval` on the built-in task."""

import io
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import disk_full_at
from safetensors.torch import load_file

from vla_rl.checkpoint import lerobot_format
from vla_rl.checkpoint import lerobot_pi as lr_import
from vla_rl.checkpoint.lerobot import import_lerobot, load_lerobot
from vla_rl.checkpoint.policy import load_any_policy, load_policy, save_policy
from vla_rl.cli import main as cli_main
from vla_rl.core.errors import CheckpointError
from vla_rl.core.ranges import ConfigError
from vla_rl.policies import flow, load_exported
from vla_rl.policies.tokenizer import SentencePieceTokenizer, TokenizerError, discretize_state, pi05_prompt

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_pi_tiny" / "lerobot-0.4.4"
TINY = {"vision": {"num_heads": 2}}
WORDS = ["pick", "up", "the", "red", "cube", "push", "blue", "block", "to", "left", "open", "drawer", "close",
         "put", "bowl", "on", "plate", "reach", "target", "go"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    """A tiny SentencePiece model in PaliGemma's layout (pad 0, eos 1, bos 2, unk 3, newline a piece, digits
    split), trained here: PaliGemma's own cannot be downloaded offline."""
    spm = pytest.importorskip("sentencepiece")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS + ["Task:", "State:", "Action:"]) for _ in range(6)) + " "
             + " ".join(str(rng.randint(0, 255)) for _ in range(4)) for _ in range(400)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=120, model_type="bpe", pad_id=0, eos_id=1,
        bos_id=2, unk_id=3, user_defined_symbols=["\n"], split_digits=True, normalization_rule_name="identity",
        add_dummy_prefix=False, remove_extra_whitespaces=False, character_coverage=1.0, minloglevel=2)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    return path


def reference_obs(ref: dict) -> dict:
    images = torch.stack([ref["img0"], ref["img1"]], dim=1).permute(0, 1, 3, 4, 2)
    return {"images": images, "image_mask": ref["img_masks"], "state": ref["state"], "tokens": ref["lang_tokens"],
            "token_mask": ref["lang_masks"]}


def ode(model, obs, noise):
    with torch.no_grad():
        return flow.sample(model.field(model.encode_prefix(obs)), noise, num_steps=5, method="ode").actions


# ----------------------------------------------------------------------------------------------------
# Tokenizer and prompts
# ----------------------------------------------------------------------------------------------------
def test_sentencepiece_tokens_padding_and_truncation(sp_model):
    import sentencepiece

    tok = SentencePieceTokenizer.from_file(sp_model)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    tokens, mask = tok(["pick up the cube\n", "go"], 12)
    first = [2, *sp.encode("pick up the cube\n")]
    assert tokens[0, : len(first)].tolist() == first and mask[0].sum() == len(first)
    assert tokens[1].tolist() == [2, *sp.encode("go"), *[0] * (11 - len(sp.encode("go")))]
    assert mask[1].tolist() == [True] * (1 + len(sp.encode("go"))) + [False] * (11 - len(sp.encode("go")))
    cut, cut_mask = tok(["pick up the red cube and push the blue block to the left"], 5)
    assert cut[0].tolist() == first[:1] + sp.encode("pick up the red cube and push the blue block to the left")[:4]
    assert cut_mask.all()
    # The policy-folder form (bytes in a safetensors file) is the same tokenizer.
    from safetensors.torch import save_file

    save_file(tok.to_tensors(), str(sp_model.parent / "tokenizer.safetensors"))
    again = SentencePieceTokenizer.from_file(sp_model.parent / "tokenizer.safetensors")
    assert torch.equal(again(["pick up the cube\n"], 12)[0], tokens[:1])


def test_tokenizer_files_that_are_not_sentencepiece_are_refused(tmp_path):
    (tmp_path / "bad.model").write_bytes(b"\x00\x01 certainly not a protobuf")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        SentencePieceTokenizer.from_file(tmp_path / "bad.model")
    with pytest.raises(TokenizerError, match="missing"):
        SentencePieceTokenizer.from_file(tmp_path / "nope.model")


def test_pi05_state_discretisation_matches_numpy_digitize():
    state = torch.tensor([[-1.0, -0.99, 0.0, 0.004, 0.99999, 1.0, 1.7, -1.2, 0.5 - 1e-7]])
    want = np.digitize(state.numpy(), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
    assert discretize_state(state).tolist() == want.tolist()
    assert want.tolist()[0][:7] == [0, 1, 128, 128, 255, 255, 255] and want[0, 7] == -1
    assert pi05_prompt(" pick_up the\ncube ", [0, 128, 255]) == "Task: pick up the cube, State: 0 128 255;\nAction: "


def test_model_prompts_follow_lerobot_processors(sp_model):
    tok = SentencePieceTokenizer.from_file(sp_model)
    for kind in ("pi0", "pi05"):
        model, _, _ = load_lerobot(FIXTURES / kind, overrides=TINY, tokenizer=sp_model)
        state = torch.tensor([[-1.0, -0.5, 0.0, 0.25, 0.5, 0.99, 1.0, 3.0]])
        prepared = model.prepare({"images": torch.zeros(1, 2, 56, 56, 3, dtype=torch.uint8), "state": state,
                                  "instruction": ["pick up the cube"]})
        text = ("pick up the cube\n" if kind == "pi0" else
                "Task: pick up the cube, State: 0 64 128 160 192 254 255 255;\nAction: ")
        want, want_mask = tok([text], model.cfg.max_text_tokens)
        assert torch.equal(prepared["tokens"], want) and torch.equal(prepared["token_mask"], want_mask), kind
        assert model.prompts(["pick up the cube"], state) == [text]


# ----------------------------------------------------------------------------------------------------
# vla-rl import lerobot
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def imported(sp_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for kind in ("pi0", "pi05"):
        out[kind] = root / kind
        assert cli_main(["import", "lerobot", str(FIXTURES / kind), str(out[kind]), "--tokenizer", str(sp_model),
                         "vision.num_heads=2"]) == 0
    return out


def test_an_imported_folder_is_readable_by_others_under_umask_022(sp_model, tmp_path):
    import os

    old = os.umask(0o022)
    try:
        assert cli_main(["import", "lerobot", str(FIXTURES / "pi0"), str(tmp_path / "out"), "--tokenizer",
                         str(sp_model), "vision.num_heads=2"]) == 0
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [tmp_path / "out", *(tmp_path / "out").rglob("*")]}
    assert modes == {p: "0o755" if (tmp_path / "out" / p).is_dir() or p == "out" else "0o644" for p in modes}, modes


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_imported_folder_reproduces_the_reference_and_survives_save_load(imported, kind, tmp_path):
    assert sorted(p.name for p in imported[kind].iterdir()) == [
        "config.yaml", "model.safetensors", "norm_stats.safetensors", "tokenizer.safetensors"]
    ref = load_file(str(FIXTURES / kind / "reference.safetensors"))
    model, norm, config = load_policy(imported[kind])
    assert config["source"]["type"] == kind and model.text_tokenizer is not None
    err = (ode(model, reference_obs(ref), ref["noise"]) - ref["actions"]).abs().max().item()
    assert err <= 1e-5, err
    again = save_policy(tmp_path / "again", model, norm)
    model2, norm2, _ = load_policy(again)
    assert torch.equal(ode(model2, reference_obs(ref), ref["noise"]), ode(model, reference_obs(ref), ref["noise"]))
    obs = {"images": torch.zeros(2, 1, 40, 64, 3, dtype=torch.uint8), "state": torch.zeros(2, 8),
           "instruction": ["pick up the cube", "go"]}
    with torch.no_grad():
        a, b = model.encode_prefix(obs), model2.encode_prefix(obs)
    assert torch.equal(a.hidden, b.hidden) and torch.equal(norm.action.std, norm2.action.std)


def test_bf16_import_keeps_bf16_weights_and_bf16_accuracy(imported, sp_model, tmp_path):
    out = tmp_path / "bf16"
    import_lerobot(FIXTURES / "pi0", out, tokenizer=sp_model, dtype="bf16", overrides=TINY)
    stored = load_file(str(out / "model.safetensors"))
    assert stored["action_in.weight"].dtype == torch.bfloat16
    assert (out / "model.safetensors").stat().st_size < 0.6 * (imported["pi0"] / "model.safetensors").stat().st_size
    ref = load_file(str(FIXTURES / "pi0" / "reference.safetensors"))
    model, _, _ = load_policy(out)
    err = (ode(model, reference_obs(ref), ref["noise"]) - ref["actions"]).abs().max().item()
    assert err < 0.05, err


def test_import_errors_name_the_problem(sp_model, tmp_path, capsys):
    assert cli_main(["import", "lerobot", str(FIXTURES / "pi0"), str(tmp_path / "a"), "vision.num_heads=2"]) == 2
    assert "no PaliGemma tokenizer found" in capsys.readouterr().err
    assert cli_main(["import", "lerobot", str(tmp_path / "missing"), str(tmp_path / "b")]) == 2
    assert "no LeRobot policy folder" in capsys.readouterr().err
    assert cli_main(["import", "openpi", str(FIXTURES / "pi0"), str(tmp_path / "c")]) == 2
    assert "not an openpi checkpoint" in (err := capsys.readouterr().err) and "vla-rl import lerobot" in err
    big = tmp_path / "big.model"
    shutil.copy(sp_model, big)
    with pytest.raises(ConfigError, match=r"unknown config key\(s\): vison \(valid: "):
        import_lerobot(FIXTURES / "pi0", tmp_path / "d", tokenizer=big, overrides={**TINY, "vison": {}})
    # a mistyped key is the user's config error, named as typed (it was a checkpoint error about `policy.vision...`)
    assert cli_main(["import", "lerobot", str(FIXTURES / "pi0"), str(tmp_path / "d"), "vision.dept=2"]) == 2
    assert capsys.readouterr().err.startswith("vla-rl: config error: unknown config key(s): vision.dept (valid: ")
    folder = tmp_path / "pi0"
    shutil.copytree(FIXTURES / "pi0", folder)
    shutil.copy(sp_model, folder / "tokenizer.model")   # found next to the checkpoint
    report = import_lerobot(folder, tmp_path / "e", overrides=TINY)
    assert report.tokenizer == str(folder / "tokenizer.model") and report.kind == "pi0"
    (tmp_path / "e" / "tokenizer.safetensors").unlink()
    with pytest.raises(CheckpointError, match="tokenizer file missing"):
        load_policy(tmp_path / "e")


def test_a_lerobot_folder_loads_directly(sp_model, tmp_path, monkeypatch):
    """``init=`` / ``vla-rl eval`` take a LeRobot folder as it is (load_any_policy imports it on the fly)."""
    monkeypatch.setitem(lr_import.SIGLIP_HEADS, 32, 2)   # the tiny SigLIP's head count, which real widths have
    folder = tmp_path / "pi05"
    shutil.copytree(FIXTURES / "pi05", folder)
    shutil.copy(sp_model, folder / "tokenizer.model")
    model, norm, config = load_any_policy(folder)
    ref = load_file(str(FIXTURES / "pi05" / "reference.safetensors"))
    assert (ode(model, reference_obs(ref), ref["noise"]) - ref["actions"]).abs().max() <= 1e-5
    assert config["source"]["type"] == "pi05" and model.text_tokenizer is not None


def test_imported_policy_exports_and_acts_with_the_policy_package(imported, tmp_path):
    out = tmp_path / "export"
    assert cli_main(["export", str(imported["pi05"]), str(out), "--dtype", "fp32", "cameras=[{name: top, height: "
                     "56, width: 56}]", "action_low=null", "action_high=null"]) == 0
    assert (out / "tokenizer.safetensors").is_file()
    policy = load_exported(out)
    a = policy.infer({"top": np.zeros((48, 64, 3), np.uint8), "state": np.zeros(8, np.float32),
                      "prompt": "pick up the cube"}, seed=0)
    assert a.shape == (6, 8) and np.isfinite(a).all()
    spec = json.loads((out / "spec.json").read_text())
    assert [c["name"] for c in spec["cameras"]] == ["top"]


# ----------------------------------------------------------------------------------------------------
# An imported π0 through the framework on the built-in task
# ----------------------------------------------------------------------------------------------------
def test_imported_pi0_runs_sft_ppo_and_eval_on_the_builtin_task(imported, tmp_path):
    """The built-in task has 1 camera (the policy's 2nd slot is masked), a 4-dim state (zero-padded to the
    checkpoint's 8 after normalising) and 2-dim actions (the first 2 of the chunk's 8); SFT recomputes the
    statistics from the demos, then PPO runs from the SFT policy with either sampler, and `vla-rl eval` reads it."""
    demos, sft = tmp_path / "demos", tmp_path / "sft"
    assert cli_main(["collect", "builtin", str(demos), "episodes=4", "seed=0"]) == 0
    assert cli_main(["sft", str(demos), f"init={imported['pi0']}", "steps=4", "batch_size=4", "warmup_steps=1",
                     "eval_episodes=4", "eval_num_envs=4", "sampler.num_steps=2", f"out={sft}", "--no-progress"]) == 0
    model, norm, config = load_policy(sft)
    assert model.cfg.tokenizer == "sentencepiece" and (sft / "tokenizer.safetensors").is_file()
    assert norm.state.mean.shape == (4,) and norm.action.mean.shape == (2,)
    before = load_policy(imported["pi0"])[0].state_dict()
    assert not torch.equal(model.state_dict()["action_in.weight"], before["action_in.weight"])   # it trained
    for method in ("noise", "sde"):
        run = tmp_path / f"rl_{method}"
        assert cli_main(["train", "builtin_flow_noise", f"init={sft}", "env.num_envs=4",
                         "env.builtin.max_episode_steps=12", "rollout_chunks=2", "execute=6", "iterations=1",
                         "eval_every=1", "eval_episodes=4", "save_every=1", f"sampler.method={method}",
                         "sampler.num_steps=2", "learner.minibatches=2", "learner.update_epochs=1", f"out={run}",
                         "tensorboard=false", "--no-progress"]) == 0
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert np.isfinite(rows[-1]["losses/policy"]) and "eval/success_once" in rows[-1]
    out = tmp_path / "eval.json"
    assert cli_main(["eval", str(tmp_path / "rl_sde"), "episodes=4", "num_envs=4", "sampler.num_steps=2",
                     f"out={out}"]) == 0
    assert out.is_file()


@pytest.mark.slow   # renders PushCube on lavapipe in worker processes: a few minutes on 2 CPU cores
def test_imported_pi0_runs_sft_ppo_and_eval_on_maniskill_with_a_camera(sp_model, tmp_path):
    """ManiSkill3 with camera observations: the render camera fills slot 0, the proprioception + task state (25+
    dims) is zero-padded into the checkpoint's 32 (the fixture's state_proj widened with zero columns, a valid
    LeRobot π0 of max_state_dim 32), pd_ee_delta_pose's 7 actions are the first 7 of 8."""
    pytest.importorskip("mani_skill")
    src = tmp_path / "pi0_32"
    shutil.copytree(FIXTURES / "pi0", src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.state_proj.weight"] = torch.cat([tensors["model.state_proj.weight"], torch.zeros(32, 24)], 1)
    from safetensors.torch import save_file

    save_file(tensors, str(src / "model.safetensors"))
    imported, demos, sft = tmp_path / "imported", tmp_path / "demos", tmp_path / "sft"
    assert cli_main(["import", "lerobot", str(src), str(imported), "--tokenizer", str(sp_model),
                     "vision.num_heads=2"]) == 0
    assert load_policy(imported)[0].cfg.state_dim == 32
    assert cli_main(["collect", "maniskill", str(demos), "task=PushCube-v1", "episodes=2", "seed=3", "obs_mode=rgb",
                     "image_size=32"]) == 0
    assert cli_main(["sft", str(demos), f"init={imported}", "steps=2", "batch_size=4", "warmup_steps=1",
                     "eval_episodes=1", "eval_num_envs=1", "sampler.num_steps=2", "execute=6", f"out={sft}",
                     "--no-progress"]) == 0
    run = tmp_path / "rl"
    for method in ("noise", "sde"):
        assert cli_main(["train", "maniskill_pushcube_flow_noise", f"init={sft}", "env.num_envs=2",
                         "env.maniskill.obs_mode=rgb", "env.maniskill.image_size=32",
                         "env.maniskill.max_episode_steps=12", "rollout_chunks=1", "execute=6", "iterations=1",
                         "eval_every=1", "eval_episodes=2", "save_every=1", f"sampler.method={method}",
                         "sampler.num_steps=2", "learner.minibatches=1", "learner.update_epochs=1",
                         "learner.critic_warmup_iters=0", "learner.actor_lr_warmup_iters=0", f"out={run}_{method}",
                         "tensorboard=false", "--no-progress"]) == 0
        rows = [json.loads(x) for x in (Path(f"{run}_{method}") / "metrics.jsonl").read_text().splitlines()]
        assert np.isfinite(rows[-1]["losses/policy"])
    assert cli_main(["eval", f"{run}_sde", "episodes=1", "num_envs=1", "sampler.num_steps=2"]) == 0


def test_the_import_hint_names_an_override_that_works(sp_model, tmp_path, capsys):
    """The tiny fixture's SigLIP width has no known head count: the error suggests an override, and that very
    spelling (not `policy.vision.num_heads`, which `vla-rl import` does not take) imports it."""
    import re

    out = tmp_path / "a"
    assert cli_main(["import", "lerobot", str(FIXTURES / "pi0"), str(out), "--tokenizer", str(sp_model)]) == 2
    err = capsys.readouterr().err
    hint = re.search(r"`vla-rl import lerobot SRC OUT (\S+)=N`", err)
    assert hint and "policy." not in hint.group(1), err
    from vla_rl.presets import parse_overrides

    lr = json.loads((FIXTURES / "pi0" / "config.json").read_text())   # what `import` does with the override
    shapes = lerobot_format.LazyWeights(FIXTURES / "pi0" / "model.safetensors").shapes
    assert lr_import.infer_policy_config(lr, shapes, parse_overrides([f"{hint.group(1)}=2"])).vision.num_heads == 2
    assert not out.exists()


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_a_full_disk_during_import_is_a_file_error_and_writes_nothing(sp_model, tmp_path, monkeypatch, capsys,
                                                                     error):
    # after the weights: the disk fills up
    monkeypatch.setattr(lerobot_format, "save_file", disk_full_at(lerobot_format.save_file, "norm_stats.safetensors",
                                                                  error))
    out = tmp_path / "out"
    assert cli_main(["import", "lerobot", str(FIXTURES / "pi0"), str(out), "--tokenizer", str(sp_model),
                     "vision.num_heads=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vla-rl: file error: could not write {out}") and "No space left on device" in err, err
    assert "nothing was written" in err and sorted(p.name for p in tmp_path.iterdir()) == []
