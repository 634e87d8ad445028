"""The message encoding of openpi's websocket protocol: msgpack, with numpy arrays as tagged maps.

An array travels as ``{b"__ndarray__": True, b"data": <raw bytes>, b"dtype": <numpy dtype str>, b"shape":
[...]}``, a numpy scalar as ``{b"__npgeneric__": True, b"data": <value>, b"dtype": <str>}`` (the layout of
``openpi_client.msgpack_numpy``). Decoding trusts nothing: only plain numeric dtypes are accepted, the shape must
account for the data's exact length, and malformed msgpack (truncated, nested too deep, non-string map keys) is
a :class:`WireError` naming the problem. Nothing is ever unpickled.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import msgpack
import numpy as np

# Plain numeric dtypes, as numpy spells them in ``dtype.str`` (little-endian, as openpi's clients send them).
DTYPES = frozenset({"|b1", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8"})
MAX_DIMS = 8
_ARRAY_KEYS = {b"__ndarray__", b"data", b"dtype", b"shape"}
_SCALAR_KEYS = {b"__npgeneric__", b"data", b"dtype"}


class WireError(ValueError):
    """A message is not valid msgpack, or holds an array that cannot be decoded safely."""


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.str not in DTYPES:
            raise TypeError(f"cannot send an array of dtype {obj.dtype}")
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        if obj.dtype.str not in DTYPES:
            raise TypeError(f"cannot send a scalar of dtype {obj.dtype}")
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a {type(obj).__name__}")


def pack(obj: Any) -> bytes:
    """Encode ``obj`` (dicts, lists, str, numbers, numpy arrays and scalars) as one message."""
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def _decode_dtype(raw: Any) -> np.dtype:
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    if not isinstance(raw, str) or raw not in DTYPES:
        raise WireError(f"array dtype {raw!r} is not accepted (plain numeric dtypes only: {sorted(DTYPES)})")
    return np.dtype(raw)


def _decode(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        if set(obj) != _ARRAY_KEYS:
            raise WireError(f"an array must have exactly the keys {sorted(_ARRAY_KEYS)}")
        data, shape, dtype = obj[b"data"], obj[b"shape"], _decode_dtype(obj[b"dtype"])
        if not isinstance(data, bytes):
            raise WireError(f"array data must be bytes, got {type(data).__name__}")
        if (not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise WireError(f"array shape must be a list of at most {MAX_DIMS} non-negative ints, got {shape!r}")
        if math.prod(shape) * dtype.itemsize != len(data):
            raise WireError(f"array of shape {list(shape)} and dtype {dtype} needs "
                            f"{math.prod(shape) * dtype.itemsize} bytes, got {len(data)}")
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    if b"__npgeneric__" in obj:
        if set(obj) != _SCALAR_KEYS:
            raise WireError(f"a numpy scalar must have exactly the keys {sorted(_SCALAR_KEYS)}")
        dtype, value = _decode_dtype(obj[b"dtype"]), obj[b"data"]
        if not isinstance(value, (bool, int, float)):
            raise WireError(f"numpy scalar data must be a number, got {type(value).__name__}")
        with warnings.catch_warnings():   # numpy 1.x wraps an out-of-range int with a warning, 2.x raises
            warnings.simplefilter("ignore")
            try:
                out = dtype.type(value)
            except (OverflowError, ValueError, TypeError):
                out = None
        if out is None or (dtype.kind in "iub" and out.item() != value):
            raise WireError(f"numpy scalar {value!r} does not fit {dtype}")
        return out
    return obj


def unpack(data: bytes) -> Any:
    """Decode one message; raise :class:`WireError` if it is not a complete, valid msgpack value."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected a binary message, got {type(data).__name__}")
    try:
        return msgpack.unpackb(data, object_hook=_decode, raw=False, strict_map_key=True)
    except WireError:
        raise
    except (ValueError, TypeError, RecursionError) as e:  # msgpack's errors: truncated, extra data, too deep, ...
        raise WireError(f"not a valid msgpack message: {type(e).__name__}: {e or 'malformed data'}") from None
