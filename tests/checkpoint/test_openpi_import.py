"""openpi's own π0 / π0.5 checkpoints (JAX orbax and PyTorch, tiny twins written by openpi's code:
scripts/fixtures/openpi_fixtures.py) and RLinf's full_weights.pt layout, imported: they reproduce openpi's
``sample_actions`` for the same inputs and noise, and bad inputs are refused by name with nothing written."""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vla_rl.checkpoint import openpi
from vla_rl.checkpoint.openpi import OpenpiImportError, import_openpi, load_openpi
from vla_rl.checkpoint.policy import foreign_kind, load_any_policy, load_policy
from vla_rl.cli import main as cli_main
from vla_rl.policies import flow
from vla_rl.policies.normalize import NormStats

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "openpi_tiny"
TOKENIZER = ROOT / "tokenizer.model"
KINDS = ["pi0", "pi05"]
FORMATS = ["jax", "pytorch"]
# The twins' settings the weights cannot tell: the chunk (10; a JAX checkpoint stores no config) and, for the
# PyTorch file, the tiny SigLIP's head count (JAX kernels keep the heads apart).
TINY = {"vision": {"num_heads": 2}, "action_horizon": 10}
CAMS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")


def reference(kind: str) -> tuple[dict, dict]:
    """openpi's recorded inputs as our observation, and its actions (reference_meta.json says how they were made)."""
    ref = load_file(str(ROOT / kind / "reference.safetensors"))
    up = 224 // ref["image_tile/base_0_rgb"].shape[1]   # images are tiles repeated (reference_meta.json: "images")
    images = torch.stack([ref[f"image_tile/{c}"].repeat_interleave(up, 1).repeat_interleave(up, 2) for c in CAMS], 1)
    obs = {"images": images.float() / 255 * 2 - 1,   # openpi's Observation.from_dict: uint8 -> [-1, 1]
           "image_mask": torch.stack([ref[f"image_mask/{c}"] for c in CAMS], 1), "state": ref["state"],
           "tokens": ref["tokenized_prompt"].long(), "token_mask": ref["tokenized_prompt_mask"]}
    return obs, ref


def actions(model, obs: dict, noise: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        return flow.sample(model.field(model.encode_prefix(obs)), noise, num_steps=steps, method="ode").actions


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_openpi_twins_reproduce_openpi_sample_actions(kind, fmt):
    """Each format against the implementation it comes from: JAX (float32 time-embedding angles) and openpi's
    PyTorch model (float64 angles); openpi's two differ from each other by up to 1.2e-4 in one step."""
    model, _, config = load_openpi(ROOT / kind / fmt, overrides=TINY)
    obs, ref = reference(kind)
    assert config["source"]["format"] == f"openpi-{fmt}" and config["source"]["type"] == kind
    assert model.cfg.time_embedding_precision == ("float32" if fmt == "jax" else "float64")
    for steps, suffix in ((5, ""), (1, "_1step")):
        got = actions(model, obs, ref["noise"], steps)
        err = (got - ref[f"actions_{fmt}{suffix}"]).abs().max().item()
        assert err <= 1e-4, (steps, err)   # measured <= 1.7e-5


@pytest.mark.parametrize("kind", KINDS)
def test_jax_and_pytorch_files_give_the_same_tensors(kind):
    a, _, _ = load_openpi(ROOT / kind / "jax", overrides=TINY)
    b, _, _ = load_openpi(ROOT / kind / "pytorch", overrides=TINY)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=0, rtol=0, msg=k)   # the converter's float32 copies


def test_import_writes_a_policy_folder_with_openpi_normalisation(tmp_path, capsys):
    out = tmp_path / "pi05"
    assert cli_main(["import", "openpi", str(ROOT / "pi05" / "jax"), str(out), "--tokenizer", str(TOKENIZER),
                     "action_horizon=10"]) == 0
    printed = capsys.readouterr().out
    assert "openpi JAX π0.5" in printed and "pi05_libero" in printed
    model, norm, config = load_policy(out)
    assert config["source"]["asset_id"] == "physical-intelligence/libero"
    assert model.cfg.state_input == "none"   # pi05_libero: discrete_state_input False
    obs, ref = reference("pi05")
    err = (actions(model, obs, ref["noise"], 5) - ref["actions_jax"]).abs().max().item()
    assert err <= 1e-4, err
    # openpi's quantile map, exactly: (x - q01) / (q99 - q01 + 1e-6) * 2 - 1
    raw = json.loads((ROOT / "pi05/jax/assets/physical-intelligence/libero/norm_stats.json").read_text())
    st = raw["norm_stats"]["state"]
    q01, q99 = torch.tensor(st["q01"]), torch.tensor(st["q99"])
    x = torch.randn(4, q01.shape[0])
    torch.testing.assert_close(norm.normalize_state(x), (x - q01) / (q99 - q01 + 1e-6) * 2 - 1)


def test_pi0_mean_std_is_openpis():
    _, norm, _ = load_openpi(ROOT / "pi0" / "pytorch", overrides=TINY)
    raw = json.loads((ROOT / "pi0/pytorch/assets/physical-intelligence/libero/norm_stats.json").read_text())
    a = raw["norm_stats"]["actions"]
    mean, std = torch.tensor(a["mean"]), torch.tensor(a["std"])
    y = torch.randn(3, mean.shape[0])
    assert norm.mode == "mean_std"
    torch.testing.assert_close(norm.action.unnormalize(y, norm.mode), y * (std + 1e-6) + mean)


def test_foreign_checkpoints_load_where_policies_do():
    """init= / eval / bench take an openpi folder as they take ours (load_any_policy)."""
    assert foreign_kind(ROOT / "pi0" / "jax") == "openpi-jax"
    assert foreign_kind(ROOT / "pi0" / "pytorch") == "openpi-pytorch"
    assert foreign_kind(ROOT) is None
    model, norm, config = load_any_policy(ROOT / "pi05" / "jax")   # settings recognised: pi05_libero (chunk 10)
    assert isinstance(norm, NormStats) and model.cfg.action_horizon == 10 and model.text_tokenizer is None


# ------------------------------------------------------------------------------------------------ RLinf
def rlinf_weights(kind: str, folder: Path, dtype=torch.float32, extra: dict | None = None) -> Path:
    """What RLinf's FSDP actor saves (rlinf/hybrid_engines/fsdp/strategy/base.py): ``torch.save`` of a flat dict of
    tensors, openpi PyTorch names, the tied embedding under both names, RLinf's value and noise heads, at
    actor/model_state_dict/full_weights.pt; the norm stats at <model_path>/<repo_id>/norm_stats.json."""
    state = load_file(str(ROOT / kind / "pytorch" / "model.safetensors"))
    emb = "paligemma_with_expert.paligemma.lm_head.weight"
    state["paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"] = state[emb]
    width = state["action_in_proj.weight"].shape[0]
    state |= {"value_head.mlp.0.weight": torch.randn(8, width), "value_head.mlp.0.bias": torch.zeros(8),
              "value_head.mlp.6.weight": torch.randn(1, 8), "value_head.mlp.6.bias": torch.zeros(1),
              "noise_head.mlp_logvar.moduleList.0.linear_1.weight": torch.randn(4, width),
              "noise_head.logvar_min": torch.tensor([-5.0]), "noise_head.logvar_max": torch.tensor([-3.6])}
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()} | (extra or {})
    f = folder / "actor" / "model_state_dict" / "full_weights.pt"   # folder: a model_path, or a global_step_N
    f.parent.mkdir(parents=True)
    torch.save(state, f)
    stats = folder / "physical-intelligence" / "libero"
    stats.mkdir(parents=True)
    shutil.copy(ROOT / kind / "pytorch/assets/physical-intelligence/libero/norm_stats.json", stats)
    return f


@pytest.mark.parametrize("kind", KINDS)
def test_rlinf_full_weights_reproduce_openpi(kind, tmp_path):
    f = rlinf_weights(kind, tmp_path / "model_path")
    out = tmp_path / "imported"
    src = f if kind == "pi0" else f.parents[2]   # the file, or the model_path folder holding actor/...
    report = import_openpi(src, out, fmt="rlinf", tokenizer=TOKENIZER, overrides=TINY)
    assert any("RLinf's own value / noise heads" in n for n in report.notes)
    model, _, config = load_policy(out)
    assert config["source"]["format"] == "rlinf"
    obs, ref = reference(kind)
    err = (actions(model, obs, ref["noise"], 5) - ref["actions_pytorch"]).abs().max().item()
    assert err <= 1e-4, err


class Payload:   # anything torch.load(weights_only=True) must refuse
    def __reduce__(self):
        return (print, ("this must never run",))


def test_rlinf_files_that_need_unpickling_are_refused_and_nothing_is_written(tmp_path, capsys):
    f = tmp_path / "full_weights.pt"
    torch.save({"action_in_proj.weight": torch.zeros(2, 2), "trap": Payload()}, f)
    with pytest.raises(OpenpiImportError, match="weights_only=True refused"):
        import_openpi(f, tmp_path / "out", fmt="rlinf", tokenizer=TOKENIZER)
    assert "this must never run" not in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    f.write_bytes(pickle.dumps({"a": 1}))   # a plain pickle, not torch's zip format
    with pytest.raises(OpenpiImportError, match="weights_only"):
        import_openpi(f, tmp_path / "out", fmt="rlinf", tokenizer=TOKENIZER)


def test_rlinf_lora_and_unknown_tensors_are_refused(tmp_path):
    lora = {"paligemma_with_expert.paligemma.base_model.model.x.lora_A.default.weight": torch.zeros(2, 2)}
    f = rlinf_weights("pi0", tmp_path / "a", extra=lora)
    with pytest.raises(OpenpiImportError, match="LoRA"):
        import_openpi(f, tmp_path / "out", fmt="rlinf", tokenizer=TOKENIZER, overrides=TINY)
    f = rlinf_weights("pi0", tmp_path / "b", extra={"rlt_module.w": torch.zeros(2)})
    with pytest.raises(OpenpiImportError, match="rlt_module.w"):
        import_openpi(f, tmp_path / "out", fmt="rlinf", tokenizer=TOKENIZER, overrides=TINY)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ bad input
def _copy(kind: str, fmt: str, tmp_path: Path) -> Path:
    dst = tmp_path / f"{kind}_{fmt}"
    shutil.copytree(ROOT / kind / fmt, dst)
    return dst


def _edit_safetensors(folder: Path, edit) -> None:
    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"))


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop("state_proj.weight"), "no model.state_proj.weight: not an openpi"),
    (lambda s: s.pop("state_proj.bias"), "missing 1 tensor"),
    (lambda s: s.update({"state_proj.weight": torch.zeros(3, 3)}), "shape"),
    (lambda s: s["action_out_proj.bias"].__setitem__(0, float("nan")), "NaN"),
    (lambda s: s.update({"mystery.weight": torch.zeros(2)}), "mystery.weight"),
])
def test_bad_pytorch_files_are_refused_by_name(tmp_path, edit, match):
    src = _copy("pi0", "pytorch", tmp_path)
    _edit_safetensors(src, edit)
    with pytest.raises(OpenpiImportError, match=match):
        import_openpi(src, tmp_path / "out", tokenizer=TOKENIZER, overrides=TINY)
    assert not (tmp_path / "out").exists()


def test_truncated_orbax_array_is_refused_by_name(tmp_path):
    src = _copy("pi0", "jax", tmp_path)
    for data in (src / "params").rglob("d/*"):
        if data.is_file():
            data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(OpenpiImportError, match="cannot (read|open) parameter"):
        import_openpi(src, tmp_path / "out", tokenizer=TOKENIZER, overrides=TINY)
    assert not (tmp_path / "out").exists()


def test_norm_stats_problems_are_named(tmp_path):
    src = _copy("pi05", "pytorch", tmp_path)
    stats = src / "assets/physical-intelligence/libero/norm_stats.json"
    raw = json.loads(stats.read_text())
    del raw["norm_stats"]["state"]["q01"]
    stats.write_text(json.dumps(raw))
    with pytest.raises(OpenpiImportError, match="q01"):
        load_openpi(src, overrides=TINY)
    shutil.copytree(ROOT / "pi05/pytorch/assets/physical-intelligence", src / "assets/other")
    with pytest.raises(OpenpiImportError, match="--asset-id"):
        load_openpi(src, overrides=TINY)
    _, norm, config = load_openpi(src, asset_id="other/libero", overrides=TINY)
    assert config["source"]["asset_id"] == "other/libero" and norm.mode == "quantile"
    shutil.rmtree(src / "assets")
    with pytest.raises(OpenpiImportError, match="--norm-stats"):
        load_openpi(src, overrides=TINY)


def test_config_names_and_kinds_are_checked(tmp_path):
    with pytest.raises(Exception, match="unknown openpi config"):
        load_openpi(ROOT / "pi0" / "pytorch", config="pi0_nowhere", overrides=TINY)
    with pytest.raises(OpenpiImportError, match="π0.5 config"):
        load_openpi(ROOT / "pi0" / "pytorch", config="pi05_libero", overrides=TINY)
    with pytest.raises(OpenpiImportError, match="not RLinf"):
        import_openpi(ROOT / "pi0" / "jax", tmp_path / "out", fmt="rlinf")
    with pytest.raises(OpenpiImportError, match="not an openpi checkpoint"):
        import_openpi(ROOT, tmp_path / "out")
    assert openpi.CONFIGS["pi05_libero"].action_horizon == 10
