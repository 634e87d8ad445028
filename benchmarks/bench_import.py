"""Peak memory of `vla-rl import lerobot` and of loading the result, on a synthetic LeRobot π0 checkpoint of realistic
size (random bf16 weights in LeRobot's tensor names, written straight to disk, never held in memory).

The checkpoint has π0's real widths (SigLIP So400m, Gemma-2B with the PaliGemma vocabulary, Gemma-300M expert) and
``--depth`` / ``--vision-depth`` layers (π0: 18 / 27, a 7 GB bf16 file; the defaults make ~2.2 GB, so the
measurement fits next to other work on a 24 GB machine). Each step runs in a fresh process; its peak resident set
(VmHWM) is reported next to the sizes of the source and of the written weights, and the process's resident set
just after ``import torch`` (the floor every step pays). Peak RSS includes the pages of the memory-mapped source
that were read (reclaimable by the kernel); the peak of anonymous memory (sampled every 5 ms) is what the step
really needs.

    python benchmarks/bench_import.py                 # ~2.2 GB bf16 source; fp32 and bf16 imports, then a load
    python benchmarks/bench_import.py --depth 18 --vision-depth 27    # the full 7 GB π0 (needs ~25 GB of RAM)
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lerobot_shapes(depth: int, vision_depth: int, vocab: int = 257152) -> dict[str, tuple[int, ...]]:
    """LeRobot π0 tensor names and shapes at π0's widths with the given depths."""
    pg = "model.paligemma_with_expert.paligemma."
    vis = pg + "model.vision_tower.vision_model."
    lm, ex = pg + "model.language_model.", "model.paligemma_with_expert.gemma_expert."
    s = {vis + "embeddings.patch_embedding.weight": (1152, 3, 14, 14), vis + "embeddings.patch_embedding.bias": (1152,),
         vis + "embeddings.position_embedding.weight": (256, 1152), vis + "post_layernorm.weight": (1152,),
         vis + "post_layernorm.bias": (1152,), pg + "model.multi_modal_projector.linear.weight": (2048, 1152),
         pg + "model.multi_modal_projector.linear.bias": (2048,), pg + "lm_head.weight": (vocab, 2048),
         lm + "norm.weight": (2048,), ex + "model.norm.weight": (1024,), ex + "lm_head.weight": (vocab, 1024),
         "model.state_proj.weight": (1024, 32), "model.state_proj.bias": (1024,),
         "model.action_in_proj.weight": (1024, 32), "model.action_in_proj.bias": (1024,),
         "model.action_out_proj.weight": (32, 1024), "model.action_out_proj.bias": (32,),
         "model.action_time_mlp_in.weight": (1024, 2048), "model.action_time_mlp_in.bias": (1024,),
         "model.action_time_mlp_out.weight": (1024, 1024), "model.action_time_mlp_out.bias": (1024,)}
    for i in range(vision_depth):
        p = f"{vis}encoder.layers.{i}."
        for n in ("layer_norm1", "layer_norm2"):
            s[p + n + ".weight"], s[p + n + ".bias"] = (1152,), (1152,)
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s[p + f"self_attn.{n}.weight"], s[p + f"self_attn.{n}.bias"] = (1152, 1152), (1152,)
        s[p + "mlp.fc1.weight"], s[p + "mlp.fc1.bias"] = (4304, 1152), (4304,)
        s[p + "mlp.fc2.weight"], s[p + "mlp.fc2.bias"] = (1152, 4304), (1152,)
    for prefix, w, mlp in ((lm, 2048, 16384), (ex + "model.", 1024, 4096)):
        for i in range(depth):
            p = f"{prefix}layers.{i}."
            s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = (w,)
            s[p + "self_attn.q_proj.weight"], s[p + "self_attn.o_proj.weight"] = (2048, w), (w, 2048)
            s[p + "self_attn.k_proj.weight"] = s[p + "self_attn.v_proj.weight"] = (256, w)
            s[p + "mlp.gate_proj.weight"] = s[p + "mlp.up_proj.weight"] = (mlp, w)
            s[p + "mlp.down_proj.weight"] = (w, mlp)
    return s


def write_synthetic(folder: Path, depth: int, vision_depth: int) -> int:
    """A LeRobot π0 folder with random bf16 weights, streamed to disk in the safetensors layout; returns its bytes."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    shapes = lerobot_shapes(depth, vision_depth)
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    gen = torch.Generator().manual_seed(0)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for shape in shapes.values():
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            f.write(t.view(torch.int16).numpy().tobytes())
    feats = {f"observation.images.{c}": {"type": "VISUAL", "shape": [3, 224, 224]}
             for c in ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")}
    config = {"type": "pi0", "input_features": {**feats, "observation.state": {"type": "STATE", "shape": [8]}},
              "output_features": {"action": {"type": "ACTION", "shape": [7]}}, "chunk_size": 50,
              "max_state_dim": 32, "max_action_dim": 32, "tokenizer_max_length": 48, "image_resolution": [224, 224],
              "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}}
    (folder / "config.json").write_text(json.dumps(config))
    import io

    import sentencepiece  # a stand-in for PaliGemma's tokenizer.model (which cannot be downloaded here)

    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(["pick up the red cube", "open the drawer"] * 50),
                                             model_writer=buf, vocab_size=20, bos_id=2, eos_id=1, pad_id=0, unk_id=3,
                                             minloglevel=2)
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    from safetensors.torch import save_file

    stats = {"observation.state.mean": torch.zeros(8), "observation.state.std": torch.ones(8),
             "action.mean": torch.zeros(7), "action.std": torch.ones(7)}
    for kind, reg in (("preprocessor", "normalizer_processor"), ("postprocessor", "unnormalizer_processor")):
        state_file = f"policy_{kind}_step_0_{reg}.safetensors"
        save_file(stats, str(folder / state_file))
        (folder / f"policy_{kind}.json").write_text(json.dumps(
            {"steps": [{"registry_name": reg, "config": {"norm_map": config["normalization_mapping"]},
                        "state_file": state_file}]}))
    return (folder / "model.safetensors").stat().st_size


STEP = textwrap.dedent("""
    import json, sys, threading, time, torch
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    anon_peak = [0]
    def sample():   # RssAnon has no high-water mark of its own: sample it
        while True:
            anon_peak[0] = max(anon_peak[0], status("RssAnon"))
            time.sleep(0.005)
    threading.Thread(target=sample, daemon=True).start()
    floor = status("VmHWM")
    from vla_rl.checkpoint.policy import load_policy
    from vla_rl.checkpoint.lerobot import import_lerobot
    what, src, out, dtype = sys.argv[1:5]
    if what == "import":
        import_lerobot(src, out, dtype=dtype)
    else:
        model, _, _ = load_policy(src)
        # Read every weight once, as a forward pass would (tensors of a file may be paged in lazily).
        assert torch.isfinite(torch.stack([p.detach().float().sum() for p in model.parameters()])).all()
    time.sleep(0.05)
    print(json.dumps({"floor": floor, "peak": status("VmHWM"), "anon": anon_peak[0]}))
""")


def run_step(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", STEP, *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, default=4, help="Gemma layers (π0: 18)")
    ap.add_argument("--vision-depth", type=int, default=6, help="SigLIP layers (π0: 27)")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temporary one, removed after)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        src_bytes = write_synthetic(tmp / "lerobot", args.depth, args.vision_depth)
        gb = 1024 ** 3
        print(f"synthetic LeRobot π0 (depth {args.depth}, SigLIP depth {args.vision_depth}): "
              f"{src_bytes / gb:.2f} GiB of bf16 weights")
        print("| step | source GiB | result GiB | peak RSS GiB | peak anonymous GiB | anonymous / result |")
        print("|---|---|---|---|---|---|")
        for dtype in ("bf16", "fp32"):
            out = tmp / f"ours_{dtype}"
            m = run_step("import", str(tmp / "lerobot"), str(out), dtype)
            written = (out / "model.safetensors").stat().st_size
            print(f"| import --dtype {dtype} | {src_bytes / gb:.2f} | {written / gb:.2f} (file) | "
                  f"{m['peak'] / gb:.2f} | {m['anon'] / gb:.2f} | {m['anon'] / written:.2f} |")
        for dtype in ("bf16", "fp32"):
            out = tmp / f"ours_{dtype}"
            size = (out / "model.safetensors").stat().st_size
            model_bytes = 2 * size if dtype == "bf16" else size
            m = run_step("load", str(out), "-", "-")
            print(f"| load_policy ({dtype} file -> fp32 model) | {size / gb:.2f} | {model_bytes / gb:.2f} (model) | "
                  f"{m['peak'] / gb:.2f} | {m['anon'] / gb:.2f} | {m['anon'] / model_bytes:.2f} |")
        print(f"floor (python + torch imported): {m['floor'] / gb:.2f} GiB. Peak RSS counts the pages of the "
              "memory-mapped source file read so far (the kernel can drop them); anonymous memory cannot be dropped.")


if __name__ == "__main__":
    main()
