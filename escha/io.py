"""escha.save_file / escha.load_file: Escha W2 checkpoints as safetensors files.

A file may mix QuantizedWeights and plain tensors (biases, norms). A QuantizedWeight named P is
stored as P.trellis, P.su, P.sv, P.scale and P.gscale, and described in the "escha" metadata
entry (docs/FORMAT.md, Storage). Loading never executes code: safetensors holds only tensors.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from typing import Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file as _st_save

from .format.qweight import TENSOR_NAMES, FormatError, QuantizedWeight
from .format.spec import FORMAT_NAME, FORMAT_VERSION, HAD_BLOCK

META_KEY = "escha"
_MAX_HEADER = 100 * 1024 * 1024


def save_file(tensors: Mapping[str, QuantizedWeight | torch.Tensor], path: str | os.PathLike,
              metadata: Mapping[str, str] | None = None) -> None:
    """Write QuantizedWeights and plain tensors to a safetensors file, atomically.

    The file appears under ``path`` only once complete (written to a temporary file beside it,
    then renamed), so an interrupted save never leaves a file that loads but is wrong.
    ``metadata`` is extra str -> str metadata; the key "escha" is reserved.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names, got {type(tensors).__name__}")
    meta = dict(metadata or {})
    if META_KEY in meta:
        raise ValueError(f"metadata key {META_KEY!r} is reserved for the format header")
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str, got {k!r}: {type(v).__name__}")
    flat: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    storages: set[int] = set()

    def put(key: str, t: torch.Tensor) -> None:
        if key in flat:
            raise ValueError(f"tensor name {key!r} is used twice")
        t = t.detach().to("cpu").contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in storages:
            t = t.clone()  # tied weights (an lm_head sharing the embedding): safetensors stores no aliases
        if t.numel():
            storages.add(t.untyped_storage().data_ptr())
        flat[key] = t

    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if isinstance(value, QuantizedWeight):
            value.validate()
            for part, t in value.tensors().items():
                put(f"{name}.{part}", t)
            entries[name] = {"shape": list(value.shape), "bits": value.bits,
                             "codebook": value.codebook_id, "had_block": value.had_block}
        elif isinstance(value, torch.Tensor):
            put(name, value)
        else:
            raise TypeError(f"{name!r}: expected QuantizedWeight or torch.Tensor, got {type(value).__name__}")
    meta[META_KEY] = json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, "tensors": entries},
                                sort_keys=True)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # else the error would name the temporary file
        raise FileNotFoundError(f"cannot write {path}: directory {folder} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"cannot write {path}: it is a directory (give a file name)")
    fd, tmp = tempfile.mkstemp(prefix=".escha-", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        _st_save(flat, tmp, metadata=meta)
        _sort_metadata(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _sort_metadata(path: str) -> None:
    """Rewrite the header of a fresh safetensors file with its metadata keys sorted, in place.

    safetensors keeps the metadata in a hash map whose order changes from one process to the
    next, so the same tensors would not always give the same bytes (a resumed quantization must
    write the files an uninterrupted one writes). Reordering keys keeps the header's length; if
    re-serializing the header as read does not give back its exact bytes, it is left alone.
    """
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
        text = raw.rstrip(b" ")  # the header is padded with spaces to 8-byte alignment
        header = json.loads(text)
        dump = lambda h: json.dumps(h, separators=(",", ":"), ensure_ascii=False).encode()  # noqa: E731
        meta = header.get("__metadata__")
        if not isinstance(meta, dict) or dump(header) != text:
            return
        header["__metadata__"] = dict(sorted(meta.items()))
        new = dump(header)
        if len(new) == len(text) and new != text:
            f.seek(8)
            f.write(new)


def read_header(path: str) -> dict:
    """The JSON header of a safetensors file, its framing checked first, so that a truncated or
    foreign file gets a FormatError naming it rather than the library's terse message."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path}: {size} bytes is too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise FormatError(f"{path}: header length {n} does not fit a {size}-byte file "
                              "(truncated, or not a safetensors file)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{path}: header is not valid JSON ({e}): not a safetensors file") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object: not a safetensors file")
    for k, v in header.items():
        if k == "__metadata__":
            if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
                raise FormatError(f"{path}: __metadata__ is not a map of strings: not a safetensors file")
        elif (not isinstance(v, dict) or not isinstance(v.get("data_offsets"), list) or len(v["data_offsets"]) != 2
              or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in v["data_offsets"])):
            raise FormatError(f"{path}: tensor {k!r} has no valid data_offsets [begin, end]: not a safetensors file")
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if ends and 8 + n + max(ends) > size:
        raise FormatError(f"{path}: tensor data ends at byte {8 + n + max(ends)} but the file has {size} (truncated)")
    return header


def _parse_meta(path: str, header: dict) -> dict[str, dict]:
    raw = (header.get("__metadata__") or {}).get(META_KEY)
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError:
        raise FormatError(f"{path}: the {META_KEY!r} metadata entry is not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise FormatError(f"{path}: metadata does not describe an {FORMAT_NAME} file")
    version = meta.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise FormatError(f"{path}: format version {version!r} is not an integer")
    if version > FORMAT_VERSION:
        raise FormatError(f"{path}: format version {version} is newer than this escha supports "
                          f"(version {FORMAT_VERSION}); upgrade escha to read it")
    if version < 1:
        raise FormatError(f"{path}: format version {version} is not valid")
    entries = meta.get("tensors")
    if not isinstance(entries, dict):
        raise FormatError(f"{path}: metadata has no 'tensors' table")
    for name, e in entries.items():
        if not isinstance(e, dict) or not {"shape", "bits", "codebook"} <= set(e):
            raise FormatError(f"{path}: entry {name!r} lacks shape, bits or codebook")
        shape = e["shape"]
        if (not isinstance(shape, list) or len(shape) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)):
            raise FormatError(f"{path}: entry {name!r} has invalid shape {shape!r}")
    return entries


def load_file(path: str | os.PathLike, device: torch.device | str = "cpu") -> dict[str, QuantizedWeight | torch.Tensor]:
    """Read a file written by save_file: QuantizedWeights under their names, other tensors as is.

    Every header field is checked against the tensors (version, K, codebook id, shapes, word
    counts, sign and scale values); anything inconsistent raises FormatError naming it. Tensors
    are placed on ``device`` (default the CPU). A missing path raises FileNotFoundError.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory, not a checkpoint file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    header = read_header(path)
    entries = _parse_meta(path, header)
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            raw = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, RuntimeError, ValueError) as e:
        raise FormatError(f"{path}: not a readable safetensors file ({e})") from None
    out: dict[str, QuantizedWeight | torch.Tensor] = {}
    used: set[str] = set()
    for name, e in entries.items():
        keys = {p: f"{name}.{p}" for p in TENSOR_NAMES}
        missing = [k for k in keys.values() if k not in raw]
        if missing:
            raise FormatError(f"{path}: quantized weight {name!r} is missing {missing}")
        try:
            qw = QuantizedWeight(**{p: raw[k] for p, k in keys.items()}, shape=tuple(e["shape"]), bits=e["bits"],
                                 codebook_id=e["codebook"], had_block=e.get("had_block", HAD_BLOCK))
        except FormatError as err:
            raise FormatError(f"{path}: {name!r}: {err}") from None
        out[name] = qw.to(device)
        used.update(keys.values())
    for k, t in raw.items():
        if k not in used:
            out[k] = t.to(device)
    return out
