"""save_file / load_file: round trips, and refusal of truncated, garbage or tampered files."""
import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file as st_load, save_file as st_save

import escha
from escha import FormatError
from escha.format import random_qweight


@pytest.fixture
def qfile(tmp_path):
    qw = random_qweight(200, 136, bits=3, seed=11)
    bias = torch.randn(200)
    path = tmp_path / "m.safetensors"
    escha.save_file({"l.weight": qw, "l.bias": bias}, path, metadata={"note": "x"})
    return path, qw, bias


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))


def test_round_trip(qfile):
    path, qw, bias = qfile
    got = escha.load_file(path)
    assert set(got) == {"l.weight", "l.bias"}
    assert got["l.weight"].shape == (200, 136) and got["l.weight"].bits == 3
    assert _equal(got["l.weight"], qw)
    assert torch.equal(got["l.bias"], bias)
    assert torch.equal(escha.dequantize(got["l.weight"]), escha.dequantize(qw))
    assert oct(os.stat(path).st_mode & 0o777) != oct(0o600)
    assert not [f for f in os.listdir(path.parent) if f.endswith(".tmp")]


def test_header_metadata_is_plain_json(qfile):
    path, _, _ = qfile
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    meta = json.loads(header["__metadata__"]["escha"])
    assert meta["format"] == "escha-w2" and meta["version"] == 1
    assert meta["tensors"]["l.weight"] == {"shape": [200, 136], "bits": 3, "codebook": 0, "had_block": 128}
    assert header["__metadata__"]["note"] == "x"
    assert header["l.weight.trellis"]["dtype"] == "I32"
    assert header["l.weight.trellis"]["shape"] == [16, 16, 24]


def _rewrite(path, mutate_meta=None, mutate_tensors=None):
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = st_load(str(path))
    if mutate_meta:
        m = json.loads(meta["escha"])
        mutate_meta(m)
        meta["escha"] = json.dumps(m)
    if mutate_tensors:
        mutate_tensors(tensors)
    st_save(tensors, str(path), metadata=meta)


def test_truncated_file(qfile):
    path, _, _ = qfile
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(FormatError, match="truncated"):
        escha.load_file(path)
    path.write_bytes(data[:5])
    with pytest.raises(FormatError, match="too short"):
        escha.load_file(path)


def test_garbage_file(tmp_path):
    p = tmp_path / "g.safetensors"
    p.write_bytes(struct.pack("<Q", 20) + b"this is not json!!!!" + b"\0" * 40)
    with pytest.raises(FormatError, match="not valid JSON"):
        escha.load_file(p)
    p.write_bytes(os.urandom(4096))
    with pytest.raises(FormatError):
        escha.load_file(p)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        escha.load_file(tmp_path / "nope.safetensors")


def test_newer_version_refused(qfile):
    path, _, _ = qfile
    _rewrite(path, mutate_meta=lambda m: m.update(version=2))
    with pytest.raises(FormatError, match="format version 2 is newer"):
        escha.load_file(path)


@pytest.mark.parametrize("field,value,msg", [
    ("bits", 5, "bits must be one of"),
    ("codebook", 9, "unknown codebook 9"),
    ("shape", [200, 300], "trellis must be"),
    ("shape", [0, 136], "invalid shape"),
    ("had_block", 64, "Hadamard block 64"),
])
def test_tampered_metadata(qfile, field, value, msg):
    path, _, _ = qfile
    _rewrite(path, mutate_meta=lambda m: m["tensors"]["l.weight"].update({field: value}))
    with pytest.raises(FormatError, match=msg):
        escha.load_file(path)


@pytest.mark.parametrize("key,make,msg", [
    ("l.weight.su", lambda t: t.fill_(3), "su must hold only"),
    ("l.weight.scale", lambda t: t.fill_(float("nan")), "scale holds NaN"),
    ("l.weight.trellis", lambda t: t[..., :5].contiguous(), "trellis must be"),
    ("l.weight.gscale", lambda t: t.double(), "gscale must be"),
])
def test_tampered_tensors(qfile, key, make, msg):
    path, _, _ = qfile

    def mutate(ts):
        ts[key] = make(ts[key].clone())
    _rewrite(path, mutate_tensors=mutate)
    with pytest.raises(FormatError, match=msg):
        escha.load_file(path)


def test_missing_part(qfile):
    path, _, _ = qfile
    _rewrite(path, mutate_tensors=lambda ts: ts.pop("l.weight.sv"))
    with pytest.raises(FormatError, match=r"missing \['l.weight.sv'\]"):
        escha.load_file(path)


def test_save_errors(tmp_path):
    qw = random_qweight(16, 16)
    with pytest.raises(ValueError, match="reserved"):
        escha.save_file({"w": qw}, tmp_path / "a.safetensors", metadata={"escha": "x"})
    with pytest.raises(ValueError, match="used twice"):
        escha.save_file({"w": qw, "w.su": torch.ones(2)}, tmp_path / "a.safetensors")
    with pytest.raises(TypeError, match="expected QuantizedWeight or torch.Tensor"):
        escha.save_file({"w": [1, 2]}, tmp_path / "a.safetensors")
    assert not list(tmp_path.iterdir())  # a failed save leaves nothing behind


def test_save_into_a_missing_directory_names_the_path(tmp_path):
    target = tmp_path / "no" / "such" / "w.safetensors"
    with pytest.raises(FileNotFoundError, match=f"^cannot write {target}: directory {target.parent} does not exist$"):
        escha.save_file({"w": random_qweight(16, 16)}, target)


def test_same_tensors_same_bytes(tmp_path):
    from escha.io import read_header
    """safetensors orders metadata by a per-map hash seed; save_file sorts it, so the bytes repeat."""
    qw = random_qweight(16, 16)
    meta = {k: k.upper() for k in ("format", "alpha", "zeta", "mid", "b", "y")}
    blobs = set()
    for i in range(12):
        escha.save_file({"w": qw, "b": torch.ones(3)}, tmp_path / f"{i}.safetensors", metadata=meta)
        blobs.add((tmp_path / f"{i}.safetensors").read_bytes())
    assert len(blobs) == 1
    assert escha.load_file(tmp_path / "0.safetensors")["b"].tolist() == [1.0, 1.0, 1.0]
    stored = read_header(str(tmp_path / "0.safetensors"))["__metadata__"]  # in file order
    assert list(stored) == sorted(stored) and stored["zeta"] == "ZETA"


def test_failed_save_keeps_old_file(tmp_path, monkeypatch):
    p = tmp_path / "a.safetensors"
    qw = random_qweight(16, 16)
    escha.save_file({"w": qw}, p)
    before = p.read_bytes()
    import escha.io as eio

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(eio, "_st_save", boom)
    with pytest.raises(OSError, match="disk full"):
        escha.save_file({"w": random_qweight(16, 16, seed=3)}, p)
    assert p.read_bytes() == before
    assert [f.name for f in tmp_path.iterdir()] == ["a.safetensors"]


def test_load_to_device_keeps_plain_files(tmp_path):
    p = tmp_path / "plain.safetensors"
    st_save({"a": torch.randn(3)}, str(p))
    assert set(escha.load_file(p)) == {"a"}


def test_tied_and_split_tensors_are_saved_as_copies(tmp_path):
    """A tied lm_head (the embedding's own tensor) and views into one storage (a fused weight cut
    into parts) are stored as separate tensors with their values: safetensors holds no aliases."""
    emb = torch.randn(10, 4)
    fused = torch.randn(6, 4)
    p = tmp_path / "tied.safetensors"
    escha.save_file({"embed": emb, "lm_head": emb, "q": fused[:2], "k": fused[2:4], "v": fused[4:]}, p)
    got = escha.load_file(p)
    assert torch.equal(got["embed"], emb) and torch.equal(got["lm_head"], emb)
    assert torch.equal(torch.cat([got["q"], got["k"], got["v"]]), fused)


def test_directories_are_named_as_such(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory"):
        escha.save_file({"b": torch.ones(2)}, tmp_path)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        escha.load_file(tmp_path)


def _raw_file(tmp_path, header: dict):
    b = json.dumps(header).encode()
    b += b" " * (-len(b) % 8)
    p = tmp_path / "raw.safetensors"
    p.write_bytes(struct.pack("<Q", len(b)) + b + b"\0" * 64)
    return p


@pytest.mark.parametrize("header,msg", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8]}}, "data_offsets"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, "8"]}}, "data_offsets"),
    ({"a": [0, 8]}, "data_offsets"),
    ({"__metadata__": [1]}, "__metadata__ is not a map of strings"),
    ({"__metadata__": {"escha": 5}}, "__metadata__ is not a map of strings"),
])
def test_malformed_headers_are_format_errors(tmp_path, header, msg):
    with pytest.raises(FormatError, match=msg):
        escha.load_file(_raw_file(tmp_path, header))
