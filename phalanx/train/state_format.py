"""The shard format phalanx.train writes for states that are not torch.distributed.checkpoint directories: JSON.

Nothing here unpickles, so reading a shard from storage cannot run code. A shard is one line of JSON (ASCII),
then a newline, then the raw bytes of the tensors and arrays the state holds, if any (none: the shard is a plain
JSON document)::

    {"format":"phalanx.train/state-v1","blobs":<bytes after the line>,"state":<the state>}\\n<blobs>

The state is JSON where JSON can say it: None, bools, ints, finite floats, strings, lists and dicts with string
keys. Everything else is a one-key object whose key starts with "$phx:":

- `{"$phx:tuple": [...]}`, `{"$phx:bytes": "<base64>"}`, `{"$phx:float": "nan" | "inf" | "-inf"}`;
- `{"$phx:dict": [[key, value], ...]}`: a dict with a key that is not a string (an optimizer's int-keyed
  `state`) or that starts with "$phx:" itself, so no user dict is ever read back as one of these;
- `{"$phx:tensor": {"dtype", "shape", "offset", "nbytes"}}`: a dense torch.Tensor (copied to the CPU; it comes
  back as a plain CPU tensor, without requires_grad);
- `{"$phx:ndarray": {"dtype", "shape", "offset", "nbytes", "scalar"}}`: a numpy array (not of dtype object), or a
  numpy scalar (`scalar` true).

Anything else (a custom object, a set, a sparse tensor) is refused when saving, with the path to it in the state.
Shards written by older phalanx.train versions are pickles: `is_state` tells them apart, and
`Checkpointer.restore` refuses to unpickle them unless asked to (`allow_pickle=True`).
"""

from __future__ import annotations

import base64
import json
import math
import sys
from collections.abc import Mapping
from typing import Any

from .errors import CheckpointError

FORMAT = "phalanx.train/state-v1"
PREFIX = b'{"format":"' + FORMAT.encode() + b'",'
TAG = "$phx:"
MAX_DEPTH = 200


class StateFormatError(CheckpointError):
    """A state that cannot be saved in the format, or a shard that is not valid in it."""


def is_state(data: bytes) -> bool:
    """Whether `data` is a shard in this format (anything else from phalanx.train is an older pickle)."""
    return data.startswith(PREFIX)


# -- encoding ---------------------------------------------------------------------------------------------------


class _Encoder:
    def __init__(self) -> None:
        self.blobs: list[bytes] = []
        self.size = 0
        self.active: set[int] = set()
        # Only when the caller has imported them (a value of theirs can only come from there): never imported here.
        self.torch: Any = sys.modules.get("torch")
        self.numpy: Any = sys.modules.get("numpy")

    def blob(self, data: bytes) -> tuple[int, int]:
        offset = self.size
        self.blobs.append(data)
        self.size += len(data)
        return offset, len(data)

    def encode(self, value: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise StateFormatError(f"cannot save state{path}: nested deeper than {MAX_DEPTH} levels")
        if value is None or isinstance(value, (bool, str)):
            return value
        np = self.numpy
        if np is not None and isinstance(value, (np.ndarray, np.generic)):
            return self.array(value, path)
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            if math.isfinite(value):
                return float(value)
            return {TAG + "float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, (bytes, bytearray, memoryview)):
            return {TAG + "bytes": base64.b64encode(bytes(value)).decode("ascii")}
        torch = self.torch
        if torch is not None and isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, (list, tuple, Mapping)):
            if id(value) in self.active:
                raise StateFormatError(f"cannot save state{path}: it contains itself")
            self.active.add(id(value))
            try:
                if isinstance(value, Mapping):
                    return self.mapping(value, path, depth)
                items = [self.encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
                return {TAG + "tuple": items} if isinstance(value, tuple) else items
            finally:
                self.active.discard(id(value))
        raise StateFormatError(
            f"cannot save state{path}: a {type(value).__module__}.{type(value).__qualname__} is not a JSON value, "
            "a torch tensor or a numpy array (phalanx.train does not pickle); convert it to those (e.g. a dict of "
            "plain values), or save a torch state_dict, which goes through torch.distributed.checkpoint"
        )

    def mapping(self, value: Mapping, path: str, depth: int) -> Any:
        if all(isinstance(k, str) and not k.startswith(TAG) for k in value):
            return {k: self.encode(v, f"{path}[{k!r}]", depth + 1) for k, v in value.items()}
        return {
            TAG + "dict": [
                [self.encode(k, f"{path} key {k!r}", depth + 1), self.encode(v, f"{path}[{k!r}]", depth + 1)]
                for k, v in value.items()
            ]
        }

    def tensor(self, t: Any, path: str) -> Any:
        torch = self.torch
        if t.layout != torch.strided or getattr(t, "is_quantized", False):
            raise StateFormatError(f"cannot save state{path}: a {t.layout} tensor (only dense tensors)")
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        offset, nbytes = self.blob(raw)
        return {
            TAG + "tensor": {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
        }

    def array(self, a: Any, path: str) -> Any:
        np = self.numpy
        scalar = isinstance(a, np.generic)
        arr = np.asarray(a)
        if arr.dtype.hasobject:
            raise StateFormatError(f"cannot save state{path}: a numpy array of Python objects")
        offset, nbytes = self.blob(np.ascontiguousarray(arr).tobytes())
        return {
            TAG + "ndarray": {
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "offset": offset,
                "nbytes": nbytes,
                "scalar": scalar,
            }
        }


def encode(state: Any) -> bytes:
    """The shard bytes of `state`; StateFormatError (naming where) for a value the format cannot hold."""
    enc = _Encoder()
    body = enc.encode(state, "")
    header = json.dumps(
        {"format": FORMAT, "blobs": enc.size, "state": body}, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )
    return b"".join([header.encode("ascii"), b"\n", *enc.blobs])


# -- decoding ---------------------------------------------------------------------------------------------------


def _bad(why: str) -> StateFormatError:
    return StateFormatError(f"not a valid {FORMAT} shard: {why}")


class _Decoder:
    def __init__(self, blobs: memoryview) -> None:
        self.blobs = blobs

    def span(self, meta: Any) -> bytes:
        if not isinstance(meta, dict):
            raise _bad("a tensor or array without its description")
        offset, nbytes = meta.get("offset"), meta.get("nbytes")
        if not (
            isinstance(offset, int)
            and isinstance(nbytes, int)
            and 0 <= offset
            and 0 <= nbytes
            and offset + nbytes <= len(self.blobs)
        ):
            raise _bad("a tensor or array outside the shard's bytes")
        return bytes(self.blobs[offset : offset + nbytes])

    @staticmethod
    def shape(meta: dict) -> tuple[int, ...]:
        shape = meta.get("shape")
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise _bad(f"bad shape {shape!r}")
        return tuple(shape)

    def decode(self, value: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH + 2:
            raise _bad("nested too deep")
        if isinstance(value, list):
            return [self.decode(v, depth + 1) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            ((key, inner),) = value.items()
            if key.startswith(TAG):
                return self.tagged(key[len(TAG) :], inner, depth)
        return {k: self.decode(v, depth + 1) for k, v in value.items()}

    def tagged(self, kind: str, inner: Any, depth: int) -> Any:
        if kind == "tuple" and isinstance(inner, list):
            return tuple(self.decode(v, depth + 1) for v in inner)
        if kind == "dict" and isinstance(inner, list):
            out = {}
            for pair in inner:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise _bad("a dict entry that is not a [key, value] pair")
                key = self.decode(pair[0], depth + 1)
                try:
                    out[key] = self.decode(pair[1], depth + 1)
                except TypeError:
                    raise _bad(f"an unhashable dict key {key!r}") from None
            return out
        if kind == "bytes" and isinstance(inner, str):
            try:
                return base64.b64decode(inner, validate=True)
            except ValueError:
                raise _bad("bad base64") from None
        if kind == "float" and inner in ("nan", "inf", "-inf"):
            return float(inner)
        if kind == "tensor":
            return self.tensor(inner)
        if kind == "ndarray":
            return self.array(inner)
        raise _bad(f"unknown tag {TAG + kind!r}")

    def tensor(self, meta: Any) -> Any:
        raw = self.span(meta)
        try:
            import torch
        except ImportError:
            raise CheckpointError("the shard holds torch tensors: install torch to restore it") from None
        dtype = getattr(torch, str(meta.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise _bad(f"unknown torch dtype {meta.get('dtype')!r}")
        shape = self.shape(meta)
        count = math.prod(shape)
        if count * dtype.itemsize != len(raw):
            raise _bad(f"a {dtype} tensor of shape {list(shape)} in {len(raw)} bytes")
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)

    def array(self, meta: Any) -> Any:
        raw = self.span(meta)
        import numpy as np

        try:
            dtype = np.dtype(str(meta.get("dtype")))
        except TypeError:
            raise _bad(f"unknown numpy dtype {meta.get('dtype')!r}") from None
        if dtype.hasobject:
            raise _bad("a numpy array of Python objects")
        shape = self.shape(meta)
        if math.prod(shape) * dtype.itemsize != len(raw):
            raise _bad(f"a {dtype} array of shape {list(shape)} in {len(raw)} bytes")
        arr = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        return arr[()] if meta.get("scalar") else arr


def decode(data: bytes) -> Any:
    """The state in a shard `encode` wrote; StateFormatError when it is not one."""
    if not is_state(data):
        raise _bad("it does not start with the format's header")
    end = data.find(b"\n")
    if end < 0:
        raise _bad("no end of the header line")
    try:
        header = json.loads(data[:end].decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(f"the header is not JSON ({exc})") from None
    blobs = memoryview(data)[end + 1 :]
    if not isinstance(header, dict) or header.get("blobs") != len(blobs) or "state" not in header:
        raise _bad("the header does not describe the shard's bytes")
    return _Decoder(blobs).decode(header["state"])
