"""Action-chunk sampling on CPU: our flow policy against LeRobot 0.4.4's ``PI0Pytorch.sample_actions``,
at the same π0-shaped dimensions, side by side in one run.

The dimensions are those of ``configs/model/pi0_cpu.yaml`` (SigLIP-like ViT 256 x 4 over one 224 px camera
with 14 px patches = 256 image tokens, 48 text tokens, prefix 512 x 4, expert 256 x 4, 8 query heads /
1 KV head of 64, MLPs 4 x the width); the action horizon / dims and the batch vary per case. Both sides run
float32 with the same thread count, K Euler steps, the prefix encoded once and cached. LeRobot's call takes
images already converted to float in [-1, 1]; ours takes them so too where the model accepts float images,
else as uint8 (then the conversion is inside our timed call).

LeRobot runs in its own virtual environment (it pins its own torch and transformers). Create it once:

    python3.11 -m venv /work/lerobot-venv
    /work/lerobot-venv/bin/pip install "lerobot[smolvla]==0.4.4"

then run (from the repository root, with the project's venv):

    python benchmarks/bench_lerobot_speed.py --lerobot-python /work/lerobot-venv/bin/python

Each side is a long-lived worker process; the driver sends one timing request at a time, alternating the
workers (the order rotates every round), so both see the same background load. A request times
``--repeats`` calls after a warm-up; the table reports the median over all rounds of wall-clock time (and
of the worker's CPU time, both threads summed, in parentheses), and ``ours / LeRobot`` from those medians.
Extra columns: ``--paths`` adds our reference sampler
(``flow.sample`` with every head and the stored chain, what PPO rollouts use) next to the deployment path.
``--split`` adds a second table, where each side's time goes (medians over ``--repeats`` calls per round):
the ViT (with the patch embedding and the projection to the prefix width), the K denoising steps (the
expert passes with their velocity head) and the rest (the prefix backbone, embeddings, masks and Euler
updates), found by timing the methods that do them (ours: ``_embed_images``, ``sampling_velocity``;
LeRobot: ``embed_image``, ``denoise_step``), with the matrix-product GFLOP of each part, counted over one more
call (linear layers, convolutions, attention; elementwise work is not counted).

The LeRobot compatibility shim (in the worker below; the installed packages are not modified):
- LeRobot checks for its patched transformers (``transformers.models.siglip.check``); stock transformers
  4.57 runs its π0 inference path unchanged, so the check module is supplied.
- Stock transformers appends every denoising step's suffix keys/values to the prefix cache (LeRobot's
  patched copy does not, and the attention mask assumes it does not). The shim makes the cache's ``update``
  return prefix + suffix without storing it, and the worker checks after each call that the cache still
  holds exactly the prefix.
- LeRobot builds Gemma / SigLIP from named variants; the shim substitutes the benchmark's dimensions and a
  1024-word vocabulary (the embedding table is only indexed, its size does not change the timing).
Numerics differ from LeRobot's patched transformers by the embedding scale factors (one multiply on the
inputs), which does not change the cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # this checkout's vla_rl, whichever copy the venv has installed


# ----------------------------------------------------------------------------------------------------
# Worker side (runs in either venv: imports only torch at the top)
# ----------------------------------------------------------------------------------------------------
def _inputs(dims: dict, batch: int, horizon: int, action_dim: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    size, text = dims["image_size"], dims["text_tokens"]
    pixels = torch.randint(0, 256, (batch, size, size, 3), generator=g, dtype=torch.uint8)
    return {
        "images": pixels.float() / 127.5 - 1.0,                              # [N, S, S, 3] in [-1, 1]
        "tokens": torch.randint(3, dims["vocab_size"], (batch, text), generator=g),
        "token_mask": torch.ones(batch, text, dtype=torch.bool),
        "state": torch.randn(batch, action_dim, generator=g),
        "noise": torch.randn(batch, horizon, action_dim, generator=g),
    }


def _lerobot_model(dims: dict, horizon: int, action_dim: int):
    """LeRobot's PI0Pytorch at the benchmark's dimensions, with the compatibility shim applied."""
    import types

    import transformers.models.siglip as siglip_pkg

    check = types.ModuleType("transformers.models.siglip.check")
    check.check_whether_transformers_replace_is_installed_correctly = lambda: True
    sys.modules["transformers.models.siglip.check"] = check
    siglip_pkg.check = check

    from lerobot.policies.pi0 import modeling_pi0 as mp
    from lerobot.policies.pi0.configuration_pi0 import PI0Config

    gemma = {
        "gemma_2b": mp.GemmaConfig(width=dims["prefix_width"], depth=dims["depth"], mlp_dim=dims["prefix_mlp"],
                                 num_heads=dims["num_heads"], num_kv_heads=dims["num_kv_heads"],
                                 head_dim=dims["head_dim"]),
        "gemma_300m": mp.GemmaConfig(width=dims["expert_width"], depth=dims["depth"], mlp_dim=dims["expert_mlp"],
                                 num_heads=dims["num_heads"], num_kv_heads=dims["num_kv_heads"],
                                 head_dim=dims["head_dim"]),
    }
    mp.get_gemma_config = lambda variant: gemma[variant]
    paligemma_cls, expert_cls = mp.PaliGemmaForConditionalGeneration, mp.GemmaForCausalLM

    def paligemma(config):
        v = config.vision_config
        v.hidden_size, v.intermediate_size = dims["vision_width"], dims["vision_mlp"]
        v.num_hidden_layers, v.num_attention_heads = dims["vision_depth"], dims["vision_heads"]
        v.patch_size, v.image_size = dims["patch_size"], dims["image_size"]
        v.projection_dim = config.text_config.hidden_size
        config.text_config.vocab_size = dims["vocab_size"]
        return paligemma_cls(config=config)

    def expert(config):
        config.vocab_size = dims["vocab_size"]
        return expert_cls(config=config)

    mp.PaliGemmaForConditionalGeneration, mp.GemmaForCausalLM = paligemma, expert

    # The prefix cache must stay the prefix: every denoising step reads it, none may append to it.
    caches = []
    forward = mp.PaliGemmaWithExpertModel.forward

    def forward_with_fixed_cache(self, *args, **kwargs):
        outputs, cache = forward(self, *args, **kwargs)
        if cache is not None:
            import torch

            def update(key, value, layer_idx, cache_kwargs=None):
                layer = cache.layers[layer_idx]
                return torch.cat([layer.keys, key], dim=-2), torch.cat([layer.values, value], dim=-2)

            cache.update = update
            caches.append(cache)
        return outputs, cache

    mp.PaliGemmaWithExpertModel.forward = forward_with_fixed_cache
    cfg = PI0Config(paligemma_variant="gemma_2b", action_expert_variant="gemma_300m", dtype="float32",
                    chunk_size=horizon, n_action_steps=horizon, max_state_dim=action_dim,
                    max_action_dim=action_dim, image_resolution=(dims["image_size"], dims["image_size"]),
                    tokenizer_max_length=dims["text_tokens"], device="cpu")
    return mp.PI0Pytorch(cfg).eval(), caches


def _lerobot_runner(dims: dict, horizon: int, action_dim: int, steps: int):
    import torch

    model, caches = _lerobot_model(dims, horizon, action_dim)
    prefix_len = dims["image_tokens"] + dims["text_tokens"]

    def prepare(x: dict) -> dict:
        return {"images": [x["images"].permute(0, 3, 1, 2).contiguous()],
                "img_masks": [torch.ones(x["images"].shape[0], dtype=torch.bool)],
                "lang_tokens": x["tokens"], "lang_masks": x["token_mask"], "state": x["state"],
                "noise": x["noise"]}

    def run(p: dict):
        caches.clear()
        with torch.inference_mode():
            out = model.sample_actions(p["images"], p["img_masks"], p["lang_tokens"], p["lang_masks"],
                                       p["state"], noise=p["noise"], num_steps=steps)
        lengths = {c.get_seq_length() for c in caches}
        if lengths != {prefix_len}:
            raise RuntimeError(f"LeRobot's prefix cache holds {lengths} tokens, expected {prefix_len}")
        return out

    return prepare, run


def _ours_runner(dims: dict, horizon: int, action_dim: int, steps: int, path: str):
    import torch

    from vla_rl.policies import flow
    from vla_rl.policies.architectures import make_policy
    from vla_rl.presets import policy_preset

    torch.manual_seed(0)
    model = make_policy(policy_preset(dims["preset"], {"action_horizon": horizon, "action_dim": action_dim,
                                                      "state_dim": action_dim})).eval()

    def prepare(x: dict) -> dict:
        images = x["images"][:, None]                                        # [N, 1, S, S, 3]
        try:
            model.prepare({"images": images, "state": x["state"], "tokens": x["tokens"],
                           "token_mask": x["token_mask"]})
        except TypeError:   # a model that takes uint8 pixels only
            images = ((images + 1.0) * 127.5).round().to(torch.uint8)
        return {"obs": {"images": images, "state": x["state"], "tokens": x["tokens"],
                        "token_mask": x["token_mask"]}, "noise": x["noise"]}

    def run(p: dict):
        with torch.inference_mode():
            if path == "fast":
                return flow.denoise(model.velocity_field(model.encode_prefix(p["obs"], hidden=False)),
                                    p["noise"], num_steps=steps)
            prefix = model.encode_prefix(p["obs"])
            return flow.sample(model.field(prefix), p["noise"], num_steps=steps, method="ode").actions

    return prepare, run


class _Split:
    """Wall and CPU seconds (and, while a :func:`_flop_mode` counts, matrix-product FLOPs) spent inside a few
    named methods, accumulated while ``on``."""

    def __init__(self):
        self.on, self.wall, self.cpu, self.flops, self.counter = False, {}, {}, {}, None

    def wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            t0, c0 = time.perf_counter(), time.process_time()
            f0 = self.counter.total if self.counter is not None else 0
            try:
                return inner(*args, **kwargs)
            finally:
                self.wall[part] = self.wall.get(part, 0.0) + time.perf_counter() - t0
                self.cpu[part] = self.cpu.get(part, 0.0) + time.process_time() - c0
                if self.counter is not None:
                    self.flops[part] = self.flops.get(part, 0) + self.counter.total - f0

        setattr(owner, name, timed)


def _flop_mode():
    """A dispatch mode that counts the FLOPs of matrix products (linear / mm / bmm, convolutions and the
    fused CPU attention, 2 per multiply-add), which torch's FlopCounterMode leaves out for CPU attention."""
    import math

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("mm", "bmm", "matmul"):
                self.total += 2 * out.numel() * args[0].shape[-1]
            elif name in ("addmm", "baddbmm"):
                self.total += 2 * out.numel() * args[1].shape[-1]
            elif name == "linear":
                self.total += 2 * out.numel() * args[0].shape[-1]
            elif "conv" in name:   # conv2d, convolution, mkldnn_convolution: whichever level dispatch shows
                self.total += 2 * out.numel() * math.prod(args[1].shape[1:])
            elif "scaled_dot_product" in name:
                q, k = args[0], args[1]
                self.total += 4 * q.numel() * k.shape[-2]   # Q K^T and P V
            return out

    return Count()


def _split_parts(kind: str) -> _Split:
    split = _Split()
    if kind == "lerobot":
        from lerobot.policies.pi0 import modeling_pi0 as mp

        split.wrap(mp.PaliGemmaWithExpertModel, "embed_image", "vit")
        split.wrap(mp.PI0Pytorch, "denoise_step", "steps")
    else:
        from vla_rl.policies.architectures import policy_class

        FlowPolicy = policy_class("pi0")   # its methods are timed: the class, not one model
        split.wrap(FlowPolicy, "_embed_images", "vit")
        split.wrap(FlowPolicy, "sampling_velocity", "steps")
    return split


def worker(kind: str, threads: int) -> None:
    """Serve timing requests (one JSON object per line on stdin, one answer per line on stdout)."""
    import torch

    torch.set_num_threads(threads)
    runners, inputs, split = {}, {}, None
    for line in sys.stdin:
        req = json.loads(line)
        dims, horizon, action_dim, batch = req["dims"], req["horizon"], req["action_dim"], req["batch"]
        key = (horizon, action_dim)
        if key not in runners:
            if kind == "lerobot":
                runners[key] = _lerobot_runner(dims, horizon, action_dim, req["steps"])
            else:
                runners[key] = _ours_runner(dims, horizon, action_dim, req["steps"], kind.split("-")[1])
        prepare, run = runners[key]
        if (key, batch) not in inputs:
            inputs[(key, batch)] = prepare(_inputs(dims, batch, horizon, action_dim))
            run(inputs[(key, batch)])                                        # warm-up
        if req.get("split"):
            split = split or _split_parts(kind)
            parts = []
            for _ in range(req["repeats"]):
                split.on, split.wall, split.cpu = True, {}, {}
                t0, c0 = time.perf_counter(), time.process_time()
                run(inputs[(key, batch)])
                split.on = False
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                parts.append({"wall": dict(split.wall, total=wall), "cpu": dict(split.cpu, total=cpu)})
            split.counter, split.flops, split.on = _flop_mode(), {}, True
            with split.counter:
                run(inputs[(key, batch)])
            flops = dict(split.flops, total=split.counter.total)
            split.counter, split.on = None, False
            print(json.dumps({"parts": parts, "flops": flops}), flush=True)
            continue
        wall, cpu = [], []
        for _ in range(req["repeats"]):
            t0, c0 = time.perf_counter(), time.process_time()
            run(inputs[(key, batch)])
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        print(json.dumps({"wall": wall, "cpu": cpu, "torch": torch.__version__}), flush=True)


# ----------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------
def bench_dims(preset: str) -> dict:
    from vla_rl.presets import policy_preset

    cfg = policy_preset(preset)
    v = cfg.vision
    return {"preset": preset, "image_size": v.image_size, "patch_size": v.patch_size, "vision_width": v.width,
            "vision_depth": v.depth, "vision_heads": v.num_heads, "vision_mlp": v.mlp_dim,
            "image_tokens": cfg.num_cameras * v.num_patches, "text_tokens": cfg.max_text_tokens,
            "vocab_size": cfg.vocab_size, "prefix_width": cfg.prefix.width, "prefix_mlp": cfg.prefix.mlp_dim,
            "expert_width": cfg.expert.width, "expert_mlp": cfg.expert.mlp_dim, "depth": cfg.depth,
            "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}


class Worker:
    def __init__(self, kind: str, python: str, threads: int):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   PYTHONPATH=str(ROOT) if kind != "lerobot" else "", TOKENIZERS_PARALLELISM="false")
        self.kind = kind
        self.proc = subprocess.Popen([python, __file__, "--worker", kind, "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=ROOT)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.kind} worker died (see its stderr above)")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lerobot-python", default="/work/lerobot-venv/bin/python")
    p.add_argument("--preset", default="pi0_cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--shapes", nargs="+", default=["10x7", "50x32"], help="HORIZONxACTION_DIM cases")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paths", nargs="+", default=["fast"], choices=["fast", "ref"],
                   help="our sampler paths to time: fast (deployment) and/or ref (flow.sample, all heads)")
    p.add_argument("--split", action="store_true",
                   help="also time where each side's chunk goes: ViT, denoising steps, the rest")
    p.add_argument("--json", help="also write the raw timings here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.threads)

    if not Path(args.lerobot_python).exists():
        sys.exit(f"no LeRobot interpreter at {args.lerobot_python}: create the venv as the docstring says")
    dims = bench_dims(args.preset)
    kinds = [f"ours-{path}" for path in args.paths] + ["lerobot"]
    workers = {k: Worker(k, args.lerobot_python if k == "lerobot" else sys.executable, args.threads)
               for k in kinds}
    cases = [(b, *map(int, s.split("x"))) for s in args.shapes for b in args.batches]
    times: dict = {(k, c): [] for k in kinds for c in cases}
    cpu: dict = {(k, c): [] for k in kinds for c in cases}
    parts: dict = {(k, c): [] for k in kinds for c in cases}
    flops: dict = {}
    versions = {}
    start = time.time()
    try:
        for r in range(args.rounds):
            for case in cases:
                batch, horizon, action_dim = case
                order = kinds[r % len(kinds):] + kinds[: r % len(kinds)]
                for k in order:
                    out = workers[k].ask({"dims": dims, "batch": batch, "horizon": horizon,
                                          "action_dim": action_dim, "steps": args.steps,
                                          "repeats": args.repeats})
                    times[(k, case)] += out["wall"]
                    cpu[(k, case)] += out["cpu"]
                    versions[k] = out["torch"]
                    if args.split:
                        out = workers[k].ask({"dims": dims, "batch": batch, "horizon": horizon,
                                              "action_dim": action_dim, "steps": args.steps,
                                              "repeats": args.repeats, "split": True})
                        parts[(k, case)] += out["parts"]
                        flops[(k, case)] = out["flops"]
            print(f"round {r + 1}/{args.rounds} done ({time.time() - start:.0f} s)", file=sys.stderr)
    finally:
        for w in workers.values():
            w.close()

    load = os.getloadavg()
    print(f"preset={args.preset} K={args.steps} threads={args.threads} float32 rounds={args.rounds} "
          f"repeats={args.repeats} torch: ours {versions['ours-' + args.paths[0]]}, LeRobot {versions['lerobot']}; "
          f"load average after the run {load[0]:.1f} on {os.cpu_count()} CPUs\n")
    med = lambda d, k, c: 1e3 * statistics.median(d[(k, c)])  # noqa: E731
    print("| batch | H | A | LeRobot wall (CPU) ms |" + "".join(
        f" ours {k[5:]} wall (CPU) ms | ours {k[5:]} / LeRobot, wall (CPU) |" for k in kinds[:-1]))
    print("|---" * (4 + 2 * (len(kinds) - 1)) + "|")
    for case in cases:
        theirs, theirs_cpu = med(times, "lerobot", case), med(cpu, "lerobot", case)
        row = f"| {case[0]} | {case[1]} | {case[2]} | {theirs:.0f} ({theirs_cpu:.0f}) |"
        for k in kinds[:-1]:
            ours, ours_cpu = med(times, k, case), med(cpu, k, case)
            row += f" {ours:.0f} ({ours_cpu:.0f}) | {ours / theirs:.2f} ({ours_cpu / theirs_cpu:.2f}) |"
        print(row)
    if args.split:
        print_split(kinds, cases, parts, flops)
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k}|{c}": {"wall": times[(k, c)], "cpu": cpu[(k, c)],
                                                            "parts": parts[(k, c)],
                                                            "flops": flops.get((k, c))}
                                               for (k, c) in times}, indent=1))


def print_split(kinds: list[str], cases: list[tuple], parts: dict, flops: dict) -> None:
    """Per part (ViT, the rest, the K denoising steps): median wall ms (CPU ms) and matrix-product GFLOP."""
    names = ("vit", "rest", "steps", "total")
    print("\n| batch | H | A | side | ViT: wall (CPU) ms, GFLOP | prefix backbone and rest | K denoising steps |"
          " total |")
    print("|---" * 8 + "|")
    for case in cases:
        for k in kinds:
            cell = {}
            for clock in ("wall", "cpu"):
                per = [{"vit": r[clock].get("vit", 0.0), "steps": r[clock].get("steps", 0.0),
                        "total": r[clock]["total"]} for r in parts[(k, case)]]
                for r in per:
                    r["rest"] = r["total"] - r["vit"] - r["steps"]
                cell[clock] = {part: 1e3 * statistics.median(r[part] for r in per) for part in names}
            f = dict(flops[(k, case)])
            f["rest"] = f["total"] - f.get("vit", 0) - f.get("steps", 0)
            side = "LeRobot" if k == "lerobot" else f"ours {k[5:]}"
            print(f"| {case[0]} | {case[1]} | {case[2]} | {side} |" + "".join(
                f" {cell['wall'][part]:.0f} ({cell['cpu'][part]:.0f}), {f.get(part, 0) / 1e9:.2f} |"
                for part in names))


if __name__ == "__main__":
    main()
