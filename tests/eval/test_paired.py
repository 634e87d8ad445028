"""Per-episode evaluation files (`vla-rl eval ... out=`) and their paired comparison (`vla-rl compare`)."""

import json
import math

import pytest
import torch

from vla_rl.checkpoint.policy import save_policy
from vla_rl.cli import main as cli_main
from vla_rl.data.collect import collect_builtin_demos
from vla_rl.eval.evaluate import evaluate_checkpoint
from vla_rl.eval.paired import EpisodeFileError, compare, load_side, paired_difference, sign_test_p
from vla_rl.policies.model import FlowPolicy
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import policy_preset

SMALL = {"depth": 1, "vision": {"depth": 1}, "prefix": {"width": 32, "mlp_dim": 64},
         "expert": {"width": 32, "mlp_dim": 64}}
EVAL = {"episodes": 12, "num_envs": 4, "env": {"builtin": {"max_episode_steps": 12}}}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """An untrained tiny policy for the built-in task: its outcomes vary by episode, which is all we need."""
    torch.manual_seed(0)
    data = collect_builtin_demos(2, seed=0)
    norm = NormStats(Stats.of(data.state), Stats.of(data.action))
    return save_policy(tmp_path_factory.mktemp("paired") / "policy", FlowPolicy(policy_preset("tiny", SMALL)), norm)


def test_paired_difference_by_hand():
    base, new = [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 1, 1]   # d = 0 0 1 0 0 1
    r = paired_difference(base, new)
    assert (r.n, r.base_mean, r.new_mean) == (6, 0.5, 5 / 6)
    assert r.diff == pytest.approx(1 / 3)
    assert r.se_paired == pytest.approx(math.sqrt((4 / 3) / 5 / 6))        # sum (d - 1/3)^2 = 4/3, ddof 1
    assert r.se_unpaired == pytest.approx(math.sqrt(0.3 / 6 + (1 / 6) / 6))
    assert (r.new_better, r.base_better, r.sign_test_p) == (2, 0, 0.5)
    # the same outcomes shuffled against each other: unpaired SE unchanged, the paired one larger
    shuffled = paired_difference([0, 0, 1, 1, 1, 0], new)
    assert shuffled.se_unpaired == pytest.approx(r.se_unpaired) and shuffled.se_paired > r.se_paired
    with pytest.raises(ValueError, match="length"):
        paired_difference([1], [1, 0])


def test_sign_test_known_values():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(5, 0) == sign_test_p(0, 5) == 2 / 32
    assert sign_test_p(3, 3) == 1.0
    assert sign_test_p(9, 1) == pytest.approx(2 * 11 / 1024)


def test_eval_writes_per_episode_records_that_pair(policy, tmp_path, capsys):
    a, b = tmp_path / "ode.json", tmp_path / "noise.json"
    m = evaluate_checkpoint(policy, {**EVAL, "out": str(a)})
    evaluate_checkpoint(policy, {**EVAL, "out": str(b), "sampler": {"method": "noise"}})
    doc = json.loads(a.read_text())
    eps = doc["episodes"]
    assert [(e["reset_seed"], e["env_index"]) for e in eps] == [(10_000 + 4 * r, i) for r in range(3) for i in range(4)]
    assert [e["episode_seed"] for e in eps] == list(range(10_000, 10_012))
    assert doc["summary"] == m and m["eval/success_once"] == sum(e["success_once"] for e in eps) / 12
    assert doc["config"]["num_envs"] == 4 and doc["env"]["kind"] == "builtin"
    # the same evaluation again reproduces every episode: a policy against itself differs by exactly 0
    same = compare(load_side([a]), load_side([a]), "return")
    assert (same.diff, same.se_paired, same.new_better, same.base_better) == (0.0, 0.0, 0, 0)
    # ODE vs the noise sampler: the numbers are those of the records, paired by episode
    r = compare(load_side([a]), load_side([b]), "return")
    nb = json.loads(b.read_text())["episodes"]
    d = [y["return"] - x["return"] for x, y in zip(eps, nb)]
    assert r.n == 12 and r.diff == pytest.approx(sum(d) / 12)
    assert r.new_better == sum(x > 0 for x in d) and r.base_better == sum(x < 0 for x in d)
    assert cli_main(["compare", str(a), str(b), "--metric", "return"]) == 0
    out = capsys.readouterr().out
    assert "return over 12 paired episodes" in out and f"{r.diff:+.4g}" in out


def test_two_seed_blocks_pool_per_side(policy, tmp_path):
    files = {}
    for name, seed in (("a10", 10_000), ("a20", 20_000), ("b10", 10_000), ("b20", 20_000)):
        method = "ode" if name[0] == "a" else "noise"
        files[name] = tmp_path / f"{name}.json"
        evaluate_checkpoint(policy, {**EVAL, "seed": seed, "sampler": {"method": method}, "out": str(files[name])})
    r = compare(load_side([files["a10"], files["a20"]]), load_side([files["b10"], files["b20"]]), "length")
    assert r.n == 24
    with pytest.raises(EpisodeFileError, match="only in the base side"):
        compare(load_side([files["a10"], files["a20"]]), load_side([files["b10"]]))
    with pytest.raises(EpisodeFileError, match="already in an earlier file"):
        load_side([files["a10"], files["a10"]])


def test_mismatched_or_broken_files_are_refused_by_name(policy, tmp_path, capsys):
    a = tmp_path / "a.json"
    evaluate_checkpoint(policy, {**EVAL, "out": str(a)})
    # another num_envs plays the same episodes: they pair by episode seed
    other_envs = tmp_path / "n6.json"
    evaluate_checkpoint(policy, {**EVAL, "num_envs": 6, "out": str(other_envs)})
    assert compare(load_side([a]), load_side([other_envs]), "length").n == 12
    other_task = tmp_path / "long.json"
    evaluate_checkpoint(policy, {**EVAL, "env": {"builtin": {"max_episode_steps": 20}}, "out": str(other_task)})
    with pytest.raises(EpisodeFileError, match="different envs: builtin.max_episode_steps 12 vs 20"):
        compare(load_side([a]), load_side([other_task]))
    # another reward: the same episodes and success (noted), but returns do not compare
    sparse = tmp_path / "sparse.json"
    evaluate_checkpoint(policy, {**EVAL, "env": {"builtin": {"max_episode_steps": 12, "reward": "sparse"}},
                                 "out": str(sparse)})
    r = compare(load_side([a]), load_side([sparse]))
    assert r.diff == 0.0 and r.env_notes == ("builtin.reward: 'dense' vs 'sparse'",)
    with pytest.raises(EpisodeFileError, match="returns under different rewards"):
        compare(load_side([a]), load_side([sparse]), "return")
    # defaults spelled out or left implicit are the same env
    spelled = tmp_path / "spelled.json"
    evaluate_checkpoint(policy, {**EVAL, "env": {"builtin": {"max_episode_steps": 12, "reward": "dense",
                                                             "step_size": 0.08}}, "out": str(spelled)})
    assert compare(load_side([a]), load_side([spelled]), "return").env_notes == ()
    with pytest.raises(EpisodeFileError, match="unknown metric"):
        compare(load_side([a]), load_side([a]), "successes")

    doc = json.loads(a.read_text())
    cases = {
        "garbage.json": "{not json",
        "format.json": json.dumps({**doc, "format": "something-else"}),
        "nokeys.json": json.dumps({**doc, "episodes": [{"reset_seed": 1}]}),
        "older.json": json.dumps({**doc, "format": "vla-rl-eval-episodes/1"}),
        "nan.json": json.dumps({**doc, "episodes": [{**doc["episodes"][0], "return": float("nan")}]}),
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(EpisodeFileError, match=name):
            load_side([tmp_path / name])
    assert cli_main(["compare", str(tmp_path / "garbage.json"), str(a)]) == 2
    assert "not a JSON evaluation file" in capsys.readouterr().err
    assert cli_main(["compare", str(tmp_path / "missing.json"), str(a)]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["compare", str(a), str(a), "metric=return"])


def test_how_a_libero_episode_is_computed_or_rendered_does_not_unpair_it(policy, tmp_path):
    # The substep loop, the model cache and soft resets give the same episodes bit for bit, reflections change
    # images only; a file written before such a field existed lacks it. The step limit changes the episodes.
    a = tmp_path / "a.json"
    evaluate_checkpoint(policy, {**EVAL, "out": str(a)})
    doc = json.loads(a.read_text())
    base = {"suite": "libero_spatial", "task_ids": [0], "max_episode_steps": None}
    sides = {"old": base, "new": {**base, "fast_substeps": True, "reflections": False, "max_cached_envs": 1},
             "longer": {**base, "max_episode_steps": 300}}
    for name, options in sides.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**doc, "env": {"kind": "libero", "options": options}}))
    r = compare(load_side([tmp_path / "old.json"]), load_side([tmp_path / "new.json"]))
    assert r.n == 12 and r.diff == 0.0 and len(r.env_notes) == 3
    with pytest.raises(EpisodeFileError, match="options.max_episode_steps None vs 300"):
        compare(load_side([tmp_path / "old.json"]), load_side([tmp_path / "longer.json"]))


def test_image_settings_of_a_state_only_env_are_not_noted(policy, tmp_path):
    # A state policy's SFT config and its RL preset may carry different image defaults; without a camera on
    # either side no frame reaches the policy, so only the fields that could matter are noted.
    a = tmp_path / "a.json"
    evaluate_checkpoint(policy, {**EVAL, "out": str(a)})
    doc = json.loads(a.read_text())
    base = {"suite": "libero_spatial", "task_ids": [0], "cameras": [], "image_size": 256,
            "image_orientation": "rot180"}
    sides = {"sft": base, "rl": {**base, "image_size": 128, "image_orientation": "upright", "direct_step": True},
             "cam": {**base, "cameras": ["agentview"]},
             "cam_rl": {**base, "cameras": ["agentview"], "image_size": 128}}
    for name, options in sides.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**doc, "env": {"kind": "libero", "options": options}}))
    side = lambda name: load_side([tmp_path / f"{name}.json"])  # noqa: E731
    assert compare(side("sft"), side("rl")).env_notes == ("options.direct_step: None vs True",)
    assert compare(side("cam"), side("cam_rl")).env_notes == ("options.image_size: 256 vs 128",)


def test_a_failed_write_leaves_the_earlier_file_whole(policy, tmp_path, monkeypatch):
    import vla_rl.eval.evaluate as ev

    a = tmp_path / "a.json"
    evaluate_checkpoint(policy, {**EVAL, "out": str(a)})
    before = a.read_text()

    def boom(*_, **__):
        raise OSError("disk full")

    monkeypatch.setattr(ev.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):   # replacing it takes --overwrite
        evaluate_checkpoint(policy, {**EVAL, "seed": 5, "out": str(a)}, overwrite=True)
    assert a.read_text() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.json"]   # no temporary file left beside it


def test_env_identity_fills_the_adapters_defaults(tmp_path):
    """An SFT policy's saved env config (every field) and a training run's preset (a few fields) name the same
    ManiSkill env; the identity written into evaluation files must say so, or their episodes would not pair."""
    import yaml

    from vla_rl.envs.registry import env_identity
    from vla_rl.eval.evaluate import checkpoint_env_config
    from vla_rl.eval.paired import env_differences

    sft, run = tmp_path / "sft", tmp_path / "run"
    sft.mkdir()
    run.mkdir()
    full = {"task": "PickCube-v1", "control_mode": "pd_ee_delta_pose", "obs_mode": "state", "reward": "sparse",
            "image_size": 64, "max_episode_steps": 150, "instruction": None, "sim_backend": "auto",
            "render_size": 256}
    (sft / "config.yaml").write_text(yaml.safe_dump({"env_config": {"kind": "maniskill", "options": full}}))
    (run / "train_config.yaml").write_text(yaml.safe_dump({"env": {"kind": "maniskill", "num_envs": 32, "options": {
        "task": "PickCube-v1", "reward": "dense_cost", "max_episode_steps": 150}}}))
    def identity(path, overrides):
        return env_identity(checkpoint_env_config(path, overrides))

    a, b = identity(sft, {}), identity(run, {})
    assert env_differences(a, b) == {"options.reward": ("sparse", "dense_cost")}
    assert env_differences(a, identity(sft, {"options": {"max_episode_steps": 50}})) == {
        "options.max_episode_steps": (150, 50)}
