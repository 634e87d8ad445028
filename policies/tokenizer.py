"""Offline instruction tokenizers (no hub download).

- ``words``: lower-cased words (punctuation split off) hashed (FNV-1a) into ``vocab_size - 3`` buckets.
  Short sequences (one token per word), which keeps the CPU-sized prefix cheap; collisions are
  negligible for the few hundred words of robot instructions.
- ``bytes``: UTF-8 bytes, exact and collision-free, but one token per character.
  For both, ids 0, 1, 2 are PAD, BOS, EOS.
- ``sentencepiece``: a SentencePiece model file (PaliGemma's ``tokenizer.model`` of an imported π0 / π0.5),
  with the prompt formats of LeRobot's π0 and π0.5 processors.
- ``hf``: a Hugging Face ``tokenizer.json`` (SmolVLM2's, of an imported SmolVLA), run by the ``tokenizers``
  package as transformers' fast tokenizers run it.

The two file tokenizers (:data:`FILE_TOKENIZERS`) travel inside a policy folder as a ``.safetensors`` file of bytes,
so every checkpoint writer carries them with the weights.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3
KINDS = ("words", "bytes")
_WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


def _fnv1a(word: str) -> int:
    h = 0x811C9DC5
    for b in word.encode("utf-8"):
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


@lru_cache(maxsize=65536)
def encode(text: str, kind: str, vocab_size: int) -> tuple[int, ...]:
    """Token ids of one instruction, without BOS/EOS (cached: instructions repeat every step)."""
    text = text.strip().lower()
    if kind == "words":
        return tuple(NUM_SPECIAL + _fnv1a(w) % (vocab_size - NUM_SPECIAL) for w in _WORD.findall(text))
    if kind == "bytes":
        if vocab_size < NUM_SPECIAL + 256:
            raise ValueError(f"the bytes tokenizer needs vocab_size >= {NUM_SPECIAL + 256}, got {vocab_size}")
        return tuple(NUM_SPECIAL + b for b in text.encode("utf-8"))
    raise ValueError(f"unknown tokenizer {kind!r}; expected one of {KINDS}")


def tokenize(texts: list[str], max_len: int, *, kind: str = "words", vocab_size: int = 1024,
             device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode instructions to ``tokens`` ``[N, L]`` long and ``mask`` ``[N, L]`` bool.

    Too long texts are truncated, keeping BOS and EOS.
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("instructions must be a list of strings")
    if max_len < 3:
        raise ValueError(f"max_len must be >= 3, got {max_len}")
    tokens = torch.full((len(texts), max_len), PAD, dtype=torch.long)
    mask = torch.zeros((len(texts), max_len), dtype=torch.bool)
    for i, text in enumerate(texts):
        ids = (BOS, *encode(text, kind, vocab_size)[: max_len - 2], EOS)
        tokens[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = True
    return tokens.to(device), mask.to(device)


# ----------------------------------------------------------------------------------------------------
# SentencePiece (PaliGemma's tokenizer, for imported π0 / π0.5) and the prompts LeRobot's processors build
# ----------------------------------------------------------------------------------------------------
class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or does not fit the policy."""


class SentencePieceTokenizer:
    """A SentencePiece model (a protobuf file, e.g. PaliGemma's ``tokenizer.model``): BOS + pieces, as
    LeRobot's PaliGemma tokenizer and openpi's ``PaligemmaTokenizer`` encode, right-padded with id 0."""

    TENSOR = "sentencepiece_model"   # the key of the proto's bytes in a tokenizer.safetensors file

    def __init__(self, model_proto: bytes, *, source: str = "<bytes>"):
        self.proto = bytes(model_proto)
        try:
            import sentencepiece
        except ImportError:
            raise TokenizerError("the sentencepiece tokenizer needs the `sentencepiece` package: "
                                 "pip install 'vla-rl[pretrained]'") from None
        self.source = source
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_proto)
        except (RuntimeError, OSError, TypeError) as e:
            raise TokenizerError(f"{source} is not a SentencePiece model: {e}") from None
        self.bos_id = self._sp.bos_id()
        if self.bos_id < 0:
            raise TokenizerError(f"{source}: the SentencePiece model has no BOS token")
        self.pad_id = max(self._sp.pad_id(), 0)
        self._cache: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def from_file(path) -> SentencePieceTokenizer:
        """From a SentencePiece ``.model`` file, or a ``.safetensors`` file that holds one (as policy folders
        keep it: a uint8 tensor, so it travels with the weights through every checkpoint writer)."""
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file missing: {path}")
        if path.suffix != ".safetensors":
            return SentencePieceTokenizer(path.read_bytes(), source=str(path))
        try:
            data = load_file(str(path)).get(SentencePieceTokenizer.TENSOR)
        except (SafetensorError, OSError, ValueError) as e:
            raise TokenizerError(f"corrupt tokenizer file {path}: {e}") from None
        if data is None or data.dtype != torch.uint8 or data.dim() != 1:
            raise TokenizerError(f"{path} holds no {SentencePieceTokenizer.TENSOR!r} uint8 tensor")
        return SentencePieceTokenizer(data.numpy().tobytes(), source=str(path))

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The ``.safetensors`` form of this tokenizer (see :meth:`from_file`)."""
        return {self.TENSOR: torch.frombuffer(bytearray(self.proto), dtype=torch.uint8)}

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> tuple[int, ...]:
        """BOS followed by the pieces of ``text`` (cached: instructions repeat every step)."""
        ids = self._cache.get(text)
        if ids is None:
            ids = (self.bos_id, *self._sp.encode(text))
            if len(self._cache) < 65536:
                self._cache[text] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([i for i in ids if i != self.bos_id])

    def __call__(self, texts: list[str], max_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens`` / ``mask`` ``[N, max_len]``: right-padded with ``pad_id``, longer prompts cut at ``max_len``
        (LeRobot's ``padding="max_length", truncation=True``)."""
        return _pad(texts, max_len, self.encode, self.pad_id, device)


def pi0_prompt(task: str) -> str:
    """π0's prompt (LeRobot's ``Pi0NewLineProcessor``): the task, ending in a newline."""
    return task if task.endswith("\n") else task + "\n"


def discretize_state(state: torch.Tensor, bins: int = 256) -> torch.Tensor:
    """π0.5's state bins ``[N, S]`` of a normalised state ``[N, S]``: ``np.digitize(x, linspace(-1, 1, bins + 1)[:-1])
    - 1`` as openpi / LeRobot compute it (in float64): [-1, 1) maps onto 0 .. bins-1, values >= 1 onto bins-1 and
    values below -1 onto -1."""
    edges = torch.linspace(-1.0, 1.0, bins + 1, dtype=torch.float64, device=state.device)[:-1]
    return torch.bucketize(state.double(), edges, right=True) - 1


def clean_task(task: str) -> str:
    """openpi's ``PaligemmaTokenizer`` cleaning of a task: stripped, ``_`` and newlines as spaces."""
    return task.strip().replace("_", " ").replace("\n", " ")


def pi05_prompt(task: str, state_bins: list[int]) -> str:
    """π0.5's prompt (openpi's ``PaligemmaTokenizer`` / LeRobot's state-tokenizer step): the cleaned task and the
    discretised state as text."""
    cleaned = clean_task(task)
    return f"Task: {cleaned}, State: {' '.join(str(int(b)) for b in state_bins)};\nAction: "


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (SmolVLM2's byte-level BPE for an imported SmolVLA): the ids its pipeline
    (normaliser, pre-tokenizer, model, post-processor) gives, as transformers' fast tokenizer gives them
    (``add_special_tokens=True``), cut at ``max_len`` and right-padded with ``pad_id`` (LeRobot's tokenizer step:
    ``truncation=True``, ``padding_side="right"``)."""

    TENSOR = "hf_tokenizer_json"   # the UTF-8 bytes of tokenizer.json
    PAD = "hf_tokenizer_pad_id"    # int64 [1]

    def __init__(self, json_text: str, pad_id: int, *, source: str = "<text>"):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError("the hf tokenizer needs the `tokenizers` package: pip install 'vla-rl[pretrained]'")\
                from None
        self.json_text, self.source = json_text, source
        try:
            self._tok = Tokenizer.from_str(json_text)
        except Exception as e:   # tokenizers raises its own Exception subclass for a malformed file
            raise TokenizerError(f"{source} is not a Hugging Face tokenizer.json: {e}") from None
        self._tok.no_padding()
        self._tok.no_truncation()
        if not 0 <= pad_id < self._tok.get_vocab_size(with_added_tokens=True):
            raise TokenizerError(f"{source}: pad id {pad_id} is not a token of the tokenizer")
        self.pad_id = int(pad_id)
        self._cache: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def from_folder(folder) -> HFTokenizer:
        """From a Hugging Face tokenizer folder: ``tokenizer.json``, the pad token named in ``tokenizer_config.json``
        (its ``pad_token``; else id 0)."""
        import json

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"tokenizer file missing: {path}")
        text = path.read_text(encoding="utf-8")
        pad = 0
        config = folder / "tokenizer_config.json"
        if config.is_file():
            token = json.loads(config.read_text(encoding="utf-8")).get("pad_token")
            token = token.get("content") if isinstance(token, dict) else token
            if token is not None:
                from tokenizers import Tokenizer

                found = Tokenizer.from_str(text).token_to_id(token)
                if found is None:
                    raise TokenizerError(f"{config}: pad_token {token!r} is not in {path}")
                pad = found
        return HFTokenizer(text, pad, source=str(path))

    @staticmethod
    def from_file(path) -> HFTokenizer:
        """From the ``.safetensors`` form (:meth:`to_tensors`) a policy folder keeps."""
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file missing: {path}")
        try:
            data = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise TokenizerError(f"corrupt tokenizer file {path}: {e}") from None
        text, pad = data.get(HFTokenizer.TENSOR), data.get(HFTokenizer.PAD)
        if text is None or text.dtype != torch.uint8 or pad is None or pad.numel() != 1:
            raise TokenizerError(f"{path} holds no {HFTokenizer.TENSOR!r} / {HFTokenizer.PAD!r} tensors")
        try:
            decoded = text.numpy().tobytes().decode("utf-8")
        except UnicodeDecodeError:
            raise TokenizerError(f"{path}: the tokenizer.json bytes are not UTF-8") from None
        return HFTokenizer(decoded, int(pad.item()), source=str(path))

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {self.TENSOR: torch.frombuffer(bytearray(self.json_text.encode("utf-8")), dtype=torch.uint8),
                self.PAD: torch.tensor([self.pad_id], dtype=torch.int64)}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> tuple[int, ...]:
        ids = self._cache.get(text)
        if ids is None:
            ids = tuple(self._tok.encode(text, add_special_tokens=True).ids)
            if len(self._cache) < 65536:
                self._cache[text] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))

    def __call__(self, texts: list[str], max_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        return _pad(texts, max_len, self.encode, self.pad_id, device)


def _pad(texts: list[str], max_len: int, encode, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` / ``mask`` ``[N, max_len]`` of ``encode(text)`` cut at ``max_len``, right-padded with ``pad_id``."""
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("instructions must be a list of strings")
    tokens = torch.full((len(texts), max_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(texts), max_len), dtype=torch.bool)
    for i, text in enumerate(texts):
        ids = encode(text)[:max_len]
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = True
    return tokens.to(device), mask.to(device)


# The tokenizers a policy folder carries as a file (``tokenizer_file``), by ``PolicyConfig.tokenizer``.
FILE_TOKENIZERS = {"sentencepiece": SentencePieceTokenizer, "hf": HFTokenizer}
