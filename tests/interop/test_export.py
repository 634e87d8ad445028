"""``vla-rl export`` and ``load_exported``: the folder, its spec, actions equal to the training actor's, bf16, the
policy package alone, observation conventions and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from exported_fixture import observation, policy_folder
from helpers import disk_full_at

from vla_rl.cli import main
from vla_rl.core.errors import CheckpointError
from vla_rl.core.outputs import OutputIsInputError
from vla_rl.core.ranges import ConfigError
from vla_rl.interop.export import export_nbytes, export_policy, resolve_source
from vla_rl.policies import ExportError, ObservationError, load_exported
from vla_rl.policies.actor import Actor, SamplerConfig
from vla_rl.policies.normalize import NormStats, Stats, actions_from_model, actions_to_model, state_to_model
from vla_rl.presets import policy_preset

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return policy_folder(tmp_path_factory.mktemp("src") / "policy")


@pytest.fixture(scope="module")
def exports(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports")
    return {dt: export_policy(source[0], out / dt, dtype=dt) for dt in ("fp32", "bf16")}


# ----------------------------------------------------------------------------------------------------
def test_unit_conversions_known_answers():
    stats = Stats(mean=torch.tensor([1.0, -2.0, 0.0]), std=torch.tensor([2.0, 0.5, 0.0]),
                  q01=torch.zeros(3), q99=torch.ones(3))
    norm = NormStats(stats, Stats(torch.tensor([0.5, 0.0]), torch.tensor([2.0, 1.0]), torch.zeros(2), torch.ones(2)),
                     hidden_state=(1,))
    x = state_to_model(norm, torch.tensor([[3.0, 7.0, 5.0]]), 5)
    # (3-1)/2 = 1; dim 1 hidden -> 0; dim 2 has no spread -> centred, unscaled; padded with zeros to 5
    assert torch.equal(x, torch.tensor([[1.0, 0.0, 5.0, 0.0, 0.0]]))
    a = actions_from_model(norm, torch.tensor([[0.1, 3.0, 9.0]]), 2, -1.0, 1.0)
    assert torch.allclose(a, torch.tensor([[0.7, 1.0]]))   # 0.1*2+0.5 = 0.7; 3*1+0 = 3 -> clipped to 1
    assert torch.allclose(actions_to_model(norm, torch.tensor([[0.7, 0.25]]), 4), torch.tensor([[0.1, 0.25, 0, 0]]))
    with pytest.raises(ValueError, match="state has 2 dims"):
        state_to_model(norm, torch.zeros(1, 2), 5)


def test_export_folder_is_self_contained(exports):
    files = sorted(os.listdir(exports["bf16"]))
    assert files == ["README.md", "config.json", "model.safetensors", "norm_stats.safetensors", "spec.json"]
    spec = json.loads((exports["bf16"] / "spec.json").read_text())
    # From the source: the built-in env's names, units, bounds and camera; SFT's execute and K; the policy's H.
    assert (spec["state_dim"], spec["action_dim"], spec["action_horizon"], spec["execute"], spec["num_steps"]) == \
        (4, 2, 8, 4, 3)
    assert spec["action_names"] == ["target_x", "target_y"] and spec["control_mode"] == "builtin:target"
    assert spec["cameras"] == [{"name": "image", "height": 32, "width": 32, "aliases": []}]
    assert (spec["action_low"], spec["action_high"]) == (-1.0, 1.0)
    config = json.loads((exports["bf16"] / "config.json").read_text())
    assert config["format"] == "vla-rl-export/1" and config["dtype"] == "bf16"
    assert config["policy"] == json.loads((exports["fp32"] / "config.json").read_text())["policy"]
    readme = (exports["bf16"] / "README.md").read_text()
    assert "Execute the first 4" in readme and "K = 3" in readme and "| 1 | target_y |" in readme


def test_exported_actions_equal_the_training_actor(source, exports):
    """Same noise, same model: the exported policy's chunk is the actor's (unnormalised, cut, clipped)."""
    _, model, norm = source
    policy = load_exported(exports["fp32"])
    actor = Actor(model, norm)
    obs = [observation(i) for i in range(3)]
    batch = {"images": torch.from_numpy(np.stack([o["image"] for o in obs]))[:, None],
             "state": torch.from_numpy(np.stack([o["state"] for o in obs])), "instruction": [o["prompt"] for o in obs]}
    with torch.inference_mode():
        want = actor.act(actor.observe(batch), SamplerConfig(num_steps=3),
                         generator=torch.Generator().manual_seed(7)).actions
    got = policy.infer({"image": batch["images"][:, 0].numpy(), "state": batch["state"].numpy(),
                        "prompt": batch["instruction"]}, seed=7)
    assert got.shape == (3, 8, 2) and got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), atol=1e-6)
    assert (np.abs(got) == 1.0).any() and (np.abs(got) < 1.0).any()   # some actions were clipped, others not
    single = policy.infer(obs[1], seed=7)   # one observation -> [H, a]; row 1 of the batch had other noise
    assert single.shape == (8, 2)


def test_bf16_export_is_half_the_size_and_acts_alike(exports):
    fp32, bf16 = (os.path.getsize(exports[k] / "model.safetensors") for k in ("fp32", "bf16"))
    assert bf16 < 0.51 * fp32, (bf16, fp32)
    ref = load_exported(exports["fp32"])
    upcast = load_exported(exports["bf16"])                 # CPU: bf16 weights computed in fp32
    native = load_exported(exports["bf16"], dtype="bf16")   # bf16 compute
    assert upcast.compute_dtype == "fp32" and native.compute_dtype == "bf16" and upcast.weight_dtype == "bf16"
    w32, w16 = ref.model.action_in.weight, upcast.model.action_in.weight
    assert not torch.equal(w32, w16) and torch.equal(w32.bfloat16().float(), w16)   # really rounded to bf16
    obs = {"image": np.stack([observation(i)["image"] for i in range(8)]),
           "state": np.stack([observation(i)["state"] for i in range(8)]), "prompt": "reach the blue target"}
    a, b, c = (p.infer(obs, seed=3) for p in (ref, upcast, native))
    scale = ref.norm.action.std.numpy()   # compare in normalised units: bf16 keeps ~3 significant digits
    assert np.abs((a - b) / scale).max() < 0.02, np.abs((a - b) / scale).max()
    assert np.abs((a - c) / scale).max() < 0.05, np.abs((a - c) / scale).max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_export_runs_in_bf16_on_cuda(exports):
    ref = load_exported(exports["fp32"])
    gpu = load_exported(exports["bf16"], device="cuda")
    assert gpu.compute_dtype == "bf16" and gpu.device.type == "cuda"
    obs = {"image": np.stack([observation(i)["image"] for i in range(8)]),
           "state": np.stack([observation(i)["state"] for i in range(8)]), "prompt": "reach the blue target"}
    a, b = ref.infer(obs, seed=3), gpu.infer(obs, seed=3)   # noise is drawn on the CPU: same on both devices
    err = np.abs((a - b) / ref.norm.action.std.numpy()).max()
    print(f"bf16 on cuda vs fp32 on cpu: max |diff| {err:.4f} (normalised units)")
    assert err < 0.05, err


@pytest.mark.parametrize("preset", ["pi0", "pi05"])
def test_pi0_size_bf16_export_is_half_the_bytes(preset):
    """Computed from the state dict on the meta device (no 3B model in memory), with the export's own conversion."""
    cfg = policy_preset(preset)
    fp32, bf16 = export_nbytes(cfg, "fp32"), export_nbytes(cfg, "bf16")
    assert fp32 > 12e9 and bf16 * 2 == fp32, (fp32, bf16)


def test_loads_with_the_policy_package_alone(exports, tmp_path):
    """A fresh interpreter that cannot import any of vla_rl but vla_rl.policies and the ground floor (vla_rl.core:
    the config schema it reads its spec with) loads the export and acts."""
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.startswith("vla_rl.") and not name.startswith(("vla_rl.policies", "vla_rl.core")):
                    raise ImportError("blocked: " + name)
                return None
        sys.meta_path.insert(0, Block())
        import numpy as np
        from vla_rl.policies import load_exported
        p = load_exported({str(exports['bf16'])!r})
        a = p.infer({{"image": np.zeros((48, 40, 3), np.uint8), "state": np.zeros(4, np.float32),
                     "prompt": "go"}}, seed=0)
        mods = sorted(m for m in sys.modules if m.startswith("vla_rl"))
        print(a.shape, mods)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("(8, 2)"), out.stdout
    loaded = eval(out.stdout.split(" ", 2)[2])
    assert all(m == "vla_rl" or m.startswith(("vla_rl.policies", "vla_rl.core")) for m in loaded), out.stdout


def test_observation_conventions_agree(exports):
    """openpi's keys, nested images, CHW, an instruction key, a batch of one: the same actions as the plain form."""
    p = load_exported(exports["fp32"])
    o = observation(3)
    want = p.infer(o, seed=1)
    forms = [
        {"observation/image": o["image"], "observation/state": o["state"], "prompt": o["prompt"]},
        {"images": {"image": o["image"]}, "state": o["state"].astype(np.float64), "instruction": o["prompt"]},
        {"image": o["image"].transpose(2, 0, 1), "state": o["state"].tolist(), "prompt": o["prompt"]},
        {"image": torch.from_numpy(o["image"]), "state": torch.from_numpy(o["state"]), "prompt": o["prompt"]},
        {**o, "seed": 1},
    ]
    for form in forms:
        np.testing.assert_array_equal(p.infer(form, seed=1) if "seed" not in form else p.infer(form), want)
    batched = p.infer({"image": o["image"][None], "state": o["state"][None], "prompt": [o["prompt"]]}, seed=1)
    np.testing.assert_array_equal(batched[0], want)
    # Other image sizes are resized to the policy's 32x32: a constant image resizes to the same constant.
    flat = {**o, "image": np.full((32, 32, 3), (90, 160, 220), np.uint8)}
    big = {**o, "image": np.full((96, 64, 3), (90, 160, 220), np.uint8)}
    np.testing.assert_allclose(p.infer(big, seed=1), p.infer(flat, seed=1), atol=1e-4)


DROP = object()
BAD = [
    ({"state": DROP}, "exactly one of"),
    ({"state": [0.0] * 3}, r"state must have shape \[4\]"),
    ({"state": [0.0, float("nan"), 0.0, 0.0]}, "NaN or inf"),
    ({"state": np.array(["a"] * 4)}, "state must be numbers"),
    ({"image": np.zeros((32, 32, 3), np.float32)}, "images must be uint8"),
    ({"image": np.zeros((32, 32), np.uint8)}, r"expected \[H, W, 3\]"),
    ({"image": np.zeros((32, 32, 4), np.uint8)}, "3 colour channels"),
    ({"image": np.zeros((4096, 8, 3), np.uint8)}, "each side must be in"),
    ({"image": "not an image"}, "expected an array"),
    ({"wrist": np.zeros((32, 32, 3), np.uint8)}, r"unknown observation key\(s\) \['wrist'\]"),
    ({"observation/image": np.zeros((32, 32, 3), np.uint8)}, "must be sent once"),
    ({"prompt": None}, "expected a string"),
    ({"prompt": "x" * 5000}, "limited to"),
    ({"instruction": "go"}, "not both"),
    ({"seed": -1}, "seed must be"),
    ({"seed": 1.5}, "seed must be"),
    ({"images": [1, 2]}, "'images' must map"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_bad_observations_are_named(exports, change, message):
    p = load_exported(exports["fp32"])
    obs = {k: v for k, v in {**observation(0), **change}.items() if v is not DROP}
    with pytest.raises(ObservationError, match=message):
        p.infer(obs)
    with pytest.raises(ObservationError, match="must be a mapping"):
        p.infer([1, 2, 3])


def test_missing_prompt_uses_the_default_instruction_or_fails(source, tmp_path):
    p = load_exported(export_policy(source[0], tmp_path / "a", dtype="fp32"))
    obs = observation(0)
    del obs["prompt"]
    with pytest.raises(ObservationError, match="needs a prompt"):
        p.infer(obs)
    q = load_exported(export_policy(source[0], tmp_path / "b", dtype="fp32",
                                    overrides={"instruction": "move to the red square"}))
    np.testing.assert_array_equal(q.infer(obs, seed=0), q.infer(observation(0), seed=0))


# ----------------------------------------------------------------------------------------------------
def _run_dir(tmp_path: Path, *, best: bool) -> Path:
    """A training run's layout: checkpoints/iter_* (+ best), each a policy folder with train_config.yaml."""
    train = {"env": {"kind": "builtin", "num_envs": 8, "builtin": {"control": "delta", "image_size": 32}},
             "execute": 6, "sampler": {"num_steps": 5, "method": "noise"}}
    run = tmp_path / "run"
    names = ["iter_000002", "iter_000004"] + (["best"] if best else [])
    for i, name in enumerate(names):
        folder, _, _ = policy_folder(run / "checkpoints" / name, meta={"env": {"kind": "builtin", "state_dim": 4,
                                                                                "action_dim": 2}})
        (folder / "train_config.yaml").write_text(yaml.safe_dump(train))
        (folder / "trainer_state.yaml").write_text(yaml.safe_dump({"iteration": 2 * (i + 1)}))
    return run


def test_training_run_sources(tmp_path):
    run = _run_dir(tmp_path / "a", best=True)
    assert resolve_source(run) == run / "checkpoints" / "best"
    assert resolve_source(_run_dir(tmp_path / "b", best=False)).name == "iter_000004"
    out = export_policy(run, tmp_path / "out", dtype="fp32")
    spec = json.loads((out / "spec.json").read_text())
    assert (spec["execute"], spec["num_steps"], spec["control_mode"]) == (6, 5, "builtin:delta")
    assert spec["action_names"] == ["dx", "dy"] and spec["source"]["iteration"] == 6
    with pytest.raises(CheckpointError, match="neither a policy folder"):
        resolve_source(tmp_path / "nothing")


def test_spec_from_libero_maniskill_and_unknown_sources(tmp_path):
    two_cams = {"num_cameras": 2, "state_dim": 8, "action_dim": 7}
    libero = {"env": {"state_dim": 8, "action_dim": 7},
              "env_config": {"kind": "libero", "libero": {"image_size": 32, "image_orientation": "rot180"}}}
    src, _, _ = policy_folder(tmp_path / "libero", meta=libero, state_dim=8, action_dim=7, overrides=two_cams)
    p = load_exported(export_policy(src, tmp_path / "libero_out", dtype="fp32"))
    assert [(c.name, c.aliases) for c in p.spec.cameras] == [("agentview", ("image",)), ("wrist", ("wrist_image",))]
    assert p.spec.state_units[:3] == ("m", "m", "m") and p.spec.action_names[-1] == "gripper"
    assert "rot180" in p.spec.notes
    # openpi's LIBERO example keys work as they are
    rng = np.random.default_rng(0)
    obs = {"observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
           "observation/wrist_image": rng.integers(0, 256, (128, 128, 3), dtype=np.uint8),
           "observation/state": rng.normal(size=8), "prompt": "pick up the black bowl"}
    assert p.infer(obs).shape == (8, 7)
    # cameras of different sizes are resized one by one: constant images give the 32x32 answer
    consts = [np.full((224, 224, 3), 40, np.uint8), np.full((128, 128, 3), 200, np.uint8)]
    mixed = {**obs, "observation/image": consts[0], "observation/wrist_image": consts[1]}
    small = {**obs, "observation/image": consts[0][:32, :32], "observation/wrist_image": consts[1][:32, :32]}
    np.testing.assert_allclose(p.infer(mixed, seed=2), p.infer(small, seed=2), atol=1e-4)

    maniskill = {"env": {"state_dim": 4, "action_dim": 2}, "env_config": {"kind": "maniskill", "maniskill": {
        "task": "PushCube-v1", "control_mode": "pd_joint_pos"}}}
    src, _, _ = policy_folder(tmp_path / "ms", meta=maniskill)
    spec = load_exported(export_policy(src, tmp_path / "ms_out", dtype="fp32")).spec
    assert spec.control_mode == "maniskill:pd_joint_pos" and spec.action_low is None and spec.instruction
    assert spec.cameras[0].name == "camera_0" and spec.cameras[0].aliases == ("image",)

    src, _, _ = policy_folder(tmp_path / "unknown", meta={})
    p = load_exported(export_policy(src, tmp_path / "unknown_out", dtype="fp32"))
    assert p.spec.action_low is None and p.spec.control_mode == "unknown" and p.spec.state_dim == 4
    assert np.abs(p.infer(observation(0, key="camera_0"), seed=0)).max() > 1.5   # not clipped to [-1, 1]


def test_overrides_and_bad_overrides(source, tmp_path):
    out = export_policy(source[0], tmp_path / "o", dtype="fp32", overrides={
        "execute": 2, "num_steps": 7, "cameras": [{"name": "top", "height": 224, "width": 224}],
        "action_low": -0.5})
    p = load_exported(out)
    assert (p.spec.execute, p.spec.num_steps, p.spec.cameras[0].name, p.spec.action_low) == (2, 7, "top", -0.5)
    assert (p.infer({**observation(0, key="top")}) >= -0.5).all()
    for bad, message in [({"execute": 9}, "execute must be in"), ({"bogus": 1}, "unknown config key"),
                         ({"num_steps": "ten"}, "expected an integer"), ({"action_low": 2.0}, "action_low <"),
                         ({"cameras": []}, "takes 1"), ({"state_names": ["x"]}, "state_names has 1")]:
        with pytest.raises(ConfigError, match=message):
            export_policy(source[0], tmp_path / "bad", dtype="fp32", overrides=bad)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match="dtype"):
        export_policy(source[0], tmp_path / "bad", dtype="fp16")


def test_tokenizer_files_travel(tmp_path):
    src, _, _ = policy_folder(tmp_path / "src")
    (src / "tokenizer.model").write_bytes(b"sentencepiece model bytes")
    out = export_policy(src, tmp_path / "out", dtype="fp32")
    assert (out / "tokenizer.model").read_bytes() == b"sentencepiece model bytes"
    assert "tokenizer.model" in (out / "README.md").read_text()
    assert load_exported(out).infer(observation(0)).shape == (8, 2)


def test_corrupt_sources_fail_and_keep_the_previous_export(source, tmp_path):
    out = export_policy(source[0], tmp_path / "out", dtype="fp32")
    before = (out / "model.safetensors").read_bytes()
    broken, model, norm = policy_folder(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        export_policy(broken, out, dtype="fp32", overwrite=True)
    with torch.no_grad():
        model.action_in.weight[0, 0] = float("nan")
    # save_policy refuses non-finite weights, so the damaged file is written by hand (a corrupted copy)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="NaN"):
        export_policy(broken, out, dtype="bf16", overwrite=True)
    assert (out / "model.safetensors").read_bytes() == before   # the earlier export is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "out"]   # no temporary folder left
    with pytest.raises(OutputIsInputError, match="lies inside the source"):
        export_policy(source[0], source[0] / "inside", dtype="fp32", overwrite=True)


def test_corrupt_exports_are_refused(exports, tmp_path):
    import shutil

    def copy(name):
        dst = tmp_path / name
        shutil.copytree(exports["fp32"], dst)
        return dst

    d = copy("unknown_key")
    cfg = json.loads((d / "config.json").read_text())
    cfg["policy"]["widht"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="policy.widht"):
        load_exported(d)
    d = copy("horizon")
    spec = json.loads((d / "spec.json").read_text())
    spec["action_horizon"] = 50
    (d / "spec.json").write_text(json.dumps(spec))
    with pytest.raises(ExportError, match="action_horizon"):
        load_exported(d)
    d = copy("truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match="corrupt safetensors"):
        load_exported(d)
    d = copy("json")
    (d / "spec.json").write_text("{not json")
    with pytest.raises(ExportError, match="corrupt JSON"):
        load_exported(d)
    d = copy("format")
    (d / "config.json").write_text(json.dumps({**cfg, "format": "other/9"}))
    with pytest.raises(ExportError, match="format"):
        load_exported(d)
    with pytest.raises(ExportError, match="no exported policy folder"):
        load_exported(tmp_path / "missing")
    from safetensors.torch import load_file, save_file

    for name in ("model", "norm_stats"):   # a NaN where the server would load it: refused, naming the tensor
        d = copy(f"nan_{name}")
        tensors = load_file(str(d / f"{name}.safetensors"))
        key = sorted(k for k, v in tensors.items() if v.is_floating_point())[0]
        tensors[key] = tensors[key].clone().fill_(float("nan"))
        save_file(tensors, str(d / f"{name}.safetensors"))
        with pytest.raises(ExportError, match=f"{name}.safetensors: {key} contains NaN or inf"):
            load_exported(d)
        assert main(["serve", str(d), "--port", "0"]) == 2


def test_cli_export(source, tmp_path, capsys):
    assert main(["export", str(source[0]), str(tmp_path / "e"), "--dtype", "fp32", "execute=2"]) == 0
    assert "execute 2" in capsys.readouterr().out
    assert load_exported(tmp_path / "e").spec.execute == 2
    assert main(["export", str(source[0]), str(tmp_path / "f"), "execute=99"]) == 2
    assert "execute must be in" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "none"), str(tmp_path / "g")]) == 2


def test_export_of_the_demo_policy_describes_its_robot_and_sampler(tmp_path):
    """`vla-rl demo` saves its SFT policy with the demo's settings: the export knows the built-in task (control
    mode, camera, bounds, names) and the demo's K and execute, and spec.json holds no absolute path."""
    from vla_rl.core.schema import to_dict
    from vla_rl.train.demo import DemoConfig

    demo = DemoConfig(sampler=SamplerConfig(num_steps=4), execute=6)
    meta = {"env": {"name": "builtin/color_reach", "state_dim": 4, "action_dim": 2}, "demo": to_dict(demo)}
    src, _, _ = policy_folder(tmp_path / "demo" / "sft", meta=meta)
    out = export_policy(src, tmp_path / "robot", dtype="fp32")
    spec = json.loads((out / "spec.json").read_text())
    assert (spec["num_steps"], spec["execute"]) == (4, 6)
    assert spec["control_mode"] == f"builtin:{demo.env.control}"
    assert spec["action_names"] == (["dx", "dy"] if demo.env.control == "delta" else ["target_x", "target_y"])
    assert (spec["action_low"], spec["action_high"]) == (-1.0, 1.0) and spec["state_names"][0] == "agent_x"
    assert [c["name"] for c in spec["cameras"]] == ["image"] and spec["source"]["unknown"] == []
    text = (out / "spec.json").read_text() + (out / "README.md").read_text() + (out / "config.json").read_text()
    assert str(tmp_path) not in text and not Path(spec["source"]["checkpoint"]).is_absolute()
    assert (out / spec["source"]["checkpoint"]).resolve() == src.resolve()


def test_cli_export_says_in_one_line_what_the_source_does_not_record(tmp_path, capsys):
    src, _, _ = policy_folder(tmp_path / "src", meta={})
    assert main(["export", str(src), str(tmp_path / "a"), "--dtype", "fp32"]) == 0
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "does not record its robot" in notes[0] and "K=10" in notes[0], notes
    assert json.loads((tmp_path / "a" / "spec.json").read_text())["source"]["unknown"][0] == "control_mode"
    assert main(["export", str(src), str(tmp_path / "b"), "--dtype", "fp32", "num_steps=5"]) == 0
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "K=10" not in notes[0]    # K was given
    src, _, _ = policy_folder(tmp_path / "known")       # BUILTIN_META: the env and the sampler are recorded
    assert main(["export", str(src), str(tmp_path / "c"), "--dtype", "fp32"]) == 0
    assert "note:" not in capsys.readouterr().out


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_a_full_disk_during_export_is_a_file_error_and_writes_nothing(source, tmp_path, monkeypatch, capsys, error):
    import vla_rl.interop.export as export_mod

    out = export_policy(source[0], tmp_path / "out", dtype="fp32")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # the second file: the disk fills up
    monkeypatch.setattr(export_mod, "save_file", disk_full_at(export_mod.save_file, "norm_stats.safetensors", error))
    assert main(["export", str(source[0]), str(out), "--dtype", "fp32", "--overwrite"]) == 2
    assert main(["export", str(source[0]), str(tmp_path / "new"), "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(e.startswith("vla-rl: file error: could not write") for e in err), err
    assert "No space left on device" in err[0] and "previous version is intact" in err[0]
    assert "nothing was written" in err[1]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]   # no temporary folder, no half export


def test_a_smolvla_exports_and_acts_as_its_actor(tmp_path):
    """The export path knows no architecture: a SmolVLA's export gives its actor's actions; an imported LeRobot
    SmolVLA exports with its SmolVLM2 tokenizer and reads prompts from the export alone."""
    src, model, norm = policy_folder(tmp_path / "policy", preset="tiny_smolvla")
    policy = load_exported(export_policy(src, tmp_path / "export", dtype="fp32"))
    actor = Actor(model, norm)
    obs = [observation(i) for i in range(2)]
    batch = {"images": torch.from_numpy(np.stack([o["image"] for o in obs]))[:, None],
             "state": torch.from_numpy(np.stack([o["state"] for o in obs])), "instruction": [o["prompt"] for o in obs]}
    with torch.inference_mode():
        want = actor.act(actor.observe(batch), SamplerConfig(num_steps=3),
                         generator=torch.Generator().manual_seed(7)).actions
    got = policy.infer({"image": batch["images"][:, 0].numpy(), "state": batch["state"].numpy(),
                        "prompt": batch["instruction"]}, seed=7)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-6)
    pytest.importorskip("tokenizers")
    from vla_rl.checkpoint.lerobot import import_lerobot

    lerobot = ROOT / "tests" / "fixtures" / "lerobot_smolvla_tiny" / "lerobot-0.6.1" / "smolvla"
    import_lerobot(lerobot, tmp_path / "imported")
    imported = load_exported(export_policy(tmp_path / "imported", tmp_path / "imported_export"))
    assert "tokenizer.safetensors" in os.listdir(tmp_path / "imported_export")
    rng = np.random.default_rng(0)
    cams = {c.name: rng.integers(0, 256, (40, 48, 3), dtype=np.uint8) for c in imported.spec.cameras}
    acts = imported.infer({**cams, "state": rng.normal(size=imported.spec.state_dim).astype(np.float32),
                           "prompt": "pick up the red cube"}, seed=1)
    assert acts.shape == (imported.spec.action_horizon, imported.spec.action_dim) and np.isfinite(acts).all()
