"""openpi's JAX checkpoints (an orbax ``params/`` item) read without JAX: the arrays through ``tensorstore`` (the
library orbax itself stores them with), the tree of parameter names from orbax's ``_METADATA`` file, and each
parameter turned into the PyTorch tensor openpi's own converter (``examples/convert_jax_model_to_pytorch.py``)
makes of it, under the name LeRobot gives it, so that :mod:`.lerobot_pi`'s mapping onto our model applies as is.

Layout facts (openpi at 15a9616, orbax-checkpoint 0.11; tests/fixtures/openpi_tiny/NOTES.md):

- ``params/_METADATA``: JSON, ``tree_metadata`` keyed by the tuple of names of each leaf, e.g.
  ``('params', 'PaliGemma', 'llm', 'layers', 'attn', 'q_einsum', 'w', 'value')``; the array's storage name joins
  them with dots. Newer checkpoints end in ``value`` (nnx), older ones do not.
- the arrays: zarr (v2) inside an OCDBT database (``manifest.ocdbt``); checkpoints without OCDBT keep one zarr
  folder per array.
- Layers are stacked on the first axis (``nn.scan``); einsum kernels keep their heads apart: ``q_einsum`` [L, N, D,
  H], ``kv_einsum`` [L, 2, K, D, H], ``attn_vec_einsum`` [L, N, H, D], ``gating_einsum`` [L, 2, D, F],
  ``linear`` [L, F, D]; Dense kernels are [in, out] (PyTorch's weight is the transpose); SigLIP's attention
  kernels are [L, W, N, H] and its patch embedding [ph, pw, C, W].
- the action expert is the second Gemma of the mixture: the same names with ``_1`` (``q_einsum_1``, ``mlp_1``,
  ``pre_attention_norm_1``, ``final_norm_1``); π0.5's expert norms are adaptive (``Dense_0`` modulation, no scale).

Arrays are read one layer at a time, so a real-size checkpoint never needs a second copy in memory.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vla_rl.core.errors import CheckpointError

_PG = "model.paligemma_with_expert.paligemma."
_VIS = _PG + "model.vision_tower.vision_model."
_LM = _PG + "model.language_model."
_EX = "model.paligemma_with_expert.gemma_expert.model."


class OrbaxError(CheckpointError):
    """An orbax ``params/`` item cannot be read."""


def _tensorstore():
    try:
        import tensorstore
    except ImportError:
        raise OrbaxError("reading openpi's JAX (orbax) checkpoints needs the tensorstore package: "
                         "pip install 'vla-rl[openpi]'") from None
    return tensorstore


def _to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype.name == "bfloat16":   # ml_dtypes' bfloat16, which torch.from_numpy does not know
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


class OrbaxParams:
    """The arrays of an orbax ``params/`` folder by their ``/``-joined names (``PaliGemma/llm/...``, without the
    leading ``params`` and trailing ``value``): shapes from the metadata, values read on demand."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        meta_file = self.folder / "_METADATA"
        if not meta_file.is_file():
            raise OrbaxError(f"{self.folder} has no _METADATA: not an orbax checkpoint item (openpi's params/)")
        try:
            tree = json.loads(meta_file.read_text())["tree_metadata"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise OrbaxError(f"{meta_file} is not orbax tree metadata: {e}") from None
        self.ocdbt = (self.folder / "manifest.ocdbt").is_file()
        self._storage: dict[str, str] = {}
        for key, entry in tree.items():
            try:
                names = [str(k["key"]) for k in entry["key_metadata"]]
            except (KeyError, TypeError):
                names = [str(k) for k in ast.literal_eval(key)]
            if (entry.get("value_metadata") or {}).get("value_type") not in (None, "jax.Array", "np.ndarray"):
                continue   # a scalar or string leaf: no array
            parts = names[1:] if names and names[0] == "params" else names
            parts = parts[:-1] if parts and parts[-1] == "value" else parts
            self._storage["/".join(parts)] = ".".join(names)
        if not self._storage:
            raise OrbaxError(f"{meta_file} lists no arrays")
        self._arrays: dict[str, object] = {}

    def names(self) -> list[str]:
        return sorted(self._storage)

    def __contains__(self, name: str) -> bool:
        return name in self._storage

    def array(self, name: str):
        """The tensorstore array ``name`` (opened once)."""
        if name not in self._storage:
            raise OrbaxError(f"{self.folder}: no parameter {name}")
        if name not in self._arrays:
            ts = _tensorstore()
            key = self._storage[name]
            if self.ocdbt:
                kv = {"driver": "ocdbt", "base": f"file://{self.folder.resolve()}/", "path": key + "/"}
            else:
                kv = {"driver": "file", "path": f"{self.folder.resolve()}/{key}/"}
            try:
                self._arrays[name] = ts.open({"driver": "zarr", "kvstore": kv, "open": True}).result()
            except Exception as e:  # noqa: BLE001 (tensorstore raises ValueError / its own status errors)
                raise OrbaxError(f"{self.folder}: cannot open parameter {name} ({key}): {e}") from None
        return self._arrays[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self.array(name).shape)

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        """``name``'s values (``index``: a leading-axes selection, e.g. one layer) as a torch tensor."""
        arr = self.array(name)
        try:
            data = (arr[index] if index else arr).read().result()
        except Exception as e:  # noqa: BLE001
            raise OrbaxError(f"{self.folder}: cannot read parameter {name}: {e} (truncated or corrupt?)") from None
        return _to_torch(np.asarray(data))


# ----------------------------------------------------------------------------------------------------
# openpi's parameters as LeRobot-named PyTorch tensors
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One PyTorch tensor: made from ``param`` (at ``index``) by ``make``; its ``shape``."""

    param: str
    index: tuple
    make: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, ...]


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.T


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def sources(params: OrbaxParams) -> dict[str, Source]:
    """Every tensor openpi's converter would write, by LeRobot name, with where it comes from."""
    out: dict[str, Source] = {}
    shape = params.shape

    def add(name: str, param: str, make=_same, index: tuple = (), out_shape: tuple | None = None):
        if param not in params:
            return
        if out_shape is None:
            s = shape(param)[len(index):]
            out_shape = tuple(reversed(s)) if make is _t else s
        out[name] = Source(param, index, make, tuple(out_shape))

    img = "PaliGemma/img/"
    if img + "embedding/kernel" in params:
        ph, pw, c, w = shape(img + "embedding/kernel")
        add(_VIS + "embeddings.patch_embedding.weight", img + "embedding/kernel", lambda x: x.permute(3, 2, 0, 1),
            out_shape=(w, c, ph, pw))
        add(_VIS + "embeddings.patch_embedding.bias", img + "embedding/bias")
        n = int(np.prod(shape(img + "pos_embedding"))) // w
        add(_VIS + "embeddings.position_embedding.weight", img + "pos_embedding", lambda x, w=w: x.reshape(-1, w),
            out_shape=(n, w))
        blk = img + "Transformer/encoderblock/"
        depth = shape(blk + "LayerNorm_0/scale")[0] if blk + "LayerNorm_0/scale" in params else 0
        attn = blk + "MultiHeadDotProductAttention_0/"
        for i in range(depth):
            lay, ix = f"{_VIS}encoder.layers.{i}.", (i,)
            for j, ours in ((0, "layer_norm1"), (1, "layer_norm2")):
                add(lay + f"{ours}.weight", blk + f"LayerNorm_{j}/scale", index=ix)
                add(lay + f"{ours}.bias", blk + f"LayerNorm_{j}/bias", index=ix)
            for j, ours in ((0, "fc1"), (1, "fc2")):
                add(lay + f"mlp.{ours}.weight", blk + f"MlpBlock_0/Dense_{j}/kernel", _t, ix)
                add(lay + f"mlp.{ours}.bias", blk + f"MlpBlock_0/Dense_{j}/bias", index=ix)
            for theirs, ours in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
                add(lay + f"self_attn.{ours}.weight", attn + f"{theirs}/kernel",            # [W, N, H] -> [N*H, W]
                    lambda x, w=w: x.reshape(w, -1).T, ix, (int(np.prod(shape(attn + f"{theirs}/kernel")[2:])), w))
                add(lay + f"self_attn.{ours}.bias", attn + f"{theirs}/bias", lambda x: x.reshape(-1), ix,
                    (int(np.prod(shape(attn + f"{theirs}/bias")[1:])),))
            add(lay + "self_attn.out_proj.weight", attn + "out/kernel",                     # [N, H, W] -> [W, N*H]
                lambda x, w=w: x.reshape(-1, w).T, ix, (w, int(np.prod(shape(attn + "out/kernel")[1:3]))))
            add(lay + "self_attn.out_proj.bias", attn + "out/bias", index=ix)
        add(_VIS + "post_layernorm.weight", img + "Transformer/encoder_norm/scale")
        add(_VIS + "post_layernorm.bias", img + "Transformer/encoder_norm/bias")
        add(_PG + "model.multi_modal_projector.linear.weight", img + "head/kernel", _t)
        add(_PG + "model.multi_modal_projector.linear.bias", img + "head/bias")

    llm = "PaliGemma/llm/"
    add(_LM + "embed_tokens.weight", llm + "embedder/input_embedding")
    for suffix, prefix in (("", _LM), ("_1", _EX)):
        q = llm + f"layers/attn/q_einsum{suffix}/w"
        if q not in params:
            continue
        depth, heads, width, head_dim = shape(q)
        kv = llm + f"layers/attn/kv_einsum{suffix}/w"
        kv_heads = shape(kv)[2] if kv in params else 1
        mlp = llm + f"layers/mlp{suffix}/"
        ffn = shape(mlp + "linear")[1] if mlp + "linear" in params else 0
        for i in range(depth):
            lay, ix = f"{prefix}layers.{i}.", (i,)
            add(lay + "self_attn.q_proj.weight", q,                                    # [N, D, H] -> [N*H, D]
                lambda x: x.permute(0, 2, 1).reshape(-1, x.shape[1]), ix, (heads * head_dim, width))
            for j, ours in ((0, "k_proj"), (1, "v_proj")):                              # [K, D, H] -> [K*H, D]
                add(lay + f"self_attn.{ours}.weight", kv, lambda x: x.permute(0, 2, 1).reshape(-1, x.shape[1]),
                    (i, j), (kv_heads * head_dim, width))
            add(lay + "self_attn.o_proj.weight", llm + f"layers/attn/attn_vec_einsum{suffix}/w",
                lambda x: x.reshape(-1, x.shape[-1]).T, ix, (width, heads * head_dim))   # [N, H, D] -> [D, N*H]
            add(lay + "mlp.gate_proj.weight", mlp + "gating_einsum", _t, (i, 0), (ffn, width))
            add(lay + "mlp.up_proj.weight", mlp + "gating_einsum", _t, (i, 1), (ffn, width))
            add(lay + "mlp.down_proj.weight", mlp + "linear", _t, ix, (width, ffn))
            for theirs, ours in (("pre_attention_norm", "input_layernorm"),
                                 ("pre_ffw_norm", "post_attention_layernorm")):
                norm = llm + f"layers/{theirs}{suffix}/"
                add(lay + f"{ours}.weight", norm + "scale", index=ix)
                add(lay + f"{ours}.dense.weight", norm + "Dense_0/kernel", _t, ix)
                add(lay + f"{ours}.dense.bias", norm + "Dense_0/bias", index=ix)
        final = llm + f"final_norm{suffix}/"
        add(prefix + "norm.weight", final + "scale")
        add(prefix + "norm.dense.weight", final + "Dense_0/kernel", _t)
        add(prefix + "norm.dense.bias", final + "Dense_0/bias")

    for proj in ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out",
                 "time_mlp_in", "time_mlp_out"):
        add(f"model.{proj}.weight", f"{proj}/kernel", _t)
        add(f"model.{proj}.bias", f"{proj}/bias")
    return out


class OrbaxWeights:
    """An openpi JAX checkpoint's ``params/`` as the tensors of a LeRobot π0 / π0.5 folder (what
    :func:`~vla_rl.checkpoint.lerobot_format.convert_weights` reads): ``shapes``, ``in`` and ``get(name)``, each
    tensor computed from its array slice when asked for. Parameters no tensor comes from are listed in
    ``unused`` (the importer refuses a checkpoint that has any: it would not know what they do)."""

    def __init__(self, folder: Path):
        self.params = OrbaxParams(folder)
        self.path = self.params.folder
        self._sources = sources(self.params)
        self.shapes = {name: s.shape for name, s in self._sources.items()}
        used = {s.param for s in self._sources.values()}
        self.unused = sorted(n for n in self.params.names() if n not in used)
        query = "PaliGemma/img/Transformer/encoderblock/MultiHeadDotProductAttention_0/query/kernel"
        self.siglip_heads = self.params.shape(query)[2] if query in self.params else None   # [L, W, N, H]

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    def get(self, name: str) -> torch.Tensor:
        s = self._sources[name]
        t = s.make(self.params.read(s.param, s.index)).contiguous()
        if tuple(t.shape) != s.shape:
            raise OrbaxError(f"{self.path}: {s.param} gives a {tuple(t.shape)} tensor for {name}, expected {s.shape}")
        return t
