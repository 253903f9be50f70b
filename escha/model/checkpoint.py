"""Reading HF safetensors checkpoints tensor by tensor, and building model skeletons.

A skeleton has its parameters on the meta device (no memory) but real buffers (rotary
frequencies, position ids), so any module can be made real by loading its parameters alone.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..format.qweight import FormatError
from ..io import read_header
from ..quant.ldlq import first_non_finite
from .errors import ModelError, UnsupportedModelError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def open_safetensors(path: str):
    """``safe_open(path)``, or a ModelError naming the file when it is not a whole safetensors file."""
    try:
        read_header(path)  # truncated and foreign files get a message naming the file
        return safe_open(path, framework="pt")
    except FormatError as e:
        raise ModelError(str(e)) from None
    except (SafetensorError, OSError) as e:
        raise ModelError(f"{path}: not a readable safetensors file ({e})") from None


def check_safetensors_files(model_dir: str) -> None:
    """Check the framing of every .safetensors file in ``model_dir`` (headers only); a ModelError
    names the first bad file."""
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            try:
                read_header(os.path.join(model_dir, name))
            except FormatError as e:
                raise ModelError(str(e)) from None


class CheckpointReader:
    """The tensors of a local HF checkpoint directory (single file or sharded with an index).

    Tensors are read one at a time with ``safe_open``, so a model of any size can be streamed.
    """

    def __init__(self, model_dir: str | os.PathLike) -> None:
        self.dir = os.fspath(model_dir)
        if not os.path.isdir(self.dir):
            raise FileNotFoundError(f"model directory not found: {self.dir}")
        if not os.path.isfile(os.path.join(self.dir, "config.json")):
            raise ModelError(f"{self.dir} has no config.json; expected a Hugging Face model directory")
        self._handles: dict[str, object] = {}
        self.key_to_file = self._index()

    def _index(self) -> dict[str, str]:
        index = os.path.join(self.dir, INDEX_NAME)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ModelError(f"{index} is not a valid safetensors index ({e})") from None
            missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(self.dir, f))})
            if missing:
                raise FileNotFoundError(f"{self.dir}: shard(s) listed in {INDEX_NAME} are missing: "
                                        f"{', '.join(missing)}")
            return dict(weight_map)
        single = os.path.join(self.dir, SINGLE_NAME)
        if os.path.isfile(single):
            self._handles = {SINGLE_NAME: open_safetensors(single)}
            return {k: SINGLE_NAME for k in self._handles[SINGLE_NAME].keys()}
        others = [f for f in os.listdir(self.dir) if f.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = f" (found {', '.join(sorted(others))}: only safetensors checkpoints are read)" if others else ""
        raise FileNotFoundError(f"{self.dir} has neither {SINGLE_NAME} nor {INDEX_NAME}{hint}")

    def keys(self) -> list[str]:
        """Every tensor name in the checkpoint, over all its shards."""
        return list(self.key_to_file)

    def __contains__(self, key: str) -> bool:
        return key in self.key_to_file

    def path(self, key: str) -> str:
        """The file holding tensor ``key``."""
        return os.path.join(self.dir, self.key_to_file[key])

    def size_bytes(self) -> int:
        """Bytes of the checkpoint's tensor files."""
        return sum(os.path.getsize(os.path.join(self.dir, f)) for f in set(self.key_to_file.values()))

    def _handle(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = open_safetensors(os.path.join(self.dir, fname))
        return self._handles[fname]

    def get(self, key: str) -> torch.Tensor:
        """One tensor, on CPU, in its stored dtype."""
        if key not in self.key_to_file:
            raise ModelError(f"{self.dir}: checkpoint has no tensor {key!r}")
        try:
            return self._handle(self.key_to_file[key]).get_tensor(key)
        except SafetensorError as e:
            raise ModelError(f"{self.path(key)}: tensor {key!r} cannot be read ({e})") from None

    def shape(self, key: str) -> list[int]:
        """A tensor's shape, read from the header without loading its data."""
        return list(self._handle(self.key_to_file[key]).get_slice(key).get_shape())


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Inside, every nn.Parameter is created on the meta device; buffers stay real.

    ``torch.empty`` for the parameter is allocated lazily by the OS and freed at once, and
    initialisers run on meta tensors for free, so a 14B skeleton costs well under a GiB.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def model_class(config):
    """The transformers class named by ``config.architectures`` (e.g. LlamaForCausalLM, BertModel)."""
    import transformers
    archs = getattr(config, "architectures", None) or []
    for name in archs:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    if archs:
        raise UnsupportedModelError(f"architecture {archs[0]!r} is not available in transformers "
                                    f"{transformers.__version__}")
    raise UnsupportedModelError("config.json names no architecture ('architectures' is empty)")


def build_skeleton(config, dtype: torch.dtype | None = None) -> nn.Module:
    """The model of ``config`` with meta parameters, in eval mode, built in ``dtype`` (None: the
    config's) as from_pretrained builds it: buffers made at construction (Gemma 3's embedding
    scale, for one) take that dtype, so a bf16 checkpoint loaded in fp32 computes in fp32."""
    cls = model_class(config)
    with meta_parameters():
        try:
            model = cls._from_config(config, **({} if dtype is None else {"dtype": dtype}))
        except Exception as e:  # transformers raises many types for configs it cannot build
            raise UnsupportedModelError(f"cannot build {cls.__name__} from config.json: {e}") from e
    return model.eval()


def find_layer_stack(model: nn.Module, num_layers: int | None) -> tuple[str, nn.ModuleList]:
    """The repeated block list (``model.layers``, ``encoder.layer``...): the longest ModuleList of one class."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            kinds = {type(m) for m in mod}
            if len(kinds) == 1 and (best is None or len(mod) > len(best[1])):
                best = (name, mod)
    if best is None or (num_layers is not None and len(best[1]) != num_layers):
        raise UnsupportedModelError(
            f"{type(model).__name__}: no stack of {num_layers} identical layers found; the pipeline "
            f"quantizes models built from a repeated block (decoder or encoder layers)")
    return best


def checkpoint_key(name: str, reader: CheckpointReader, prefix: str) -> str | None:
    """The checkpoint key for a model tensor name, allowing for a base-model prefix either way."""
    candidates = [name]
    if prefix:
        candidates += [f"{prefix}.{name}", name[len(prefix) + 1:] if name.startswith(prefix + ".") else None]
    for c in candidates:
        if c is not None and c in reader:
            return c
    return None


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` in place of the parameter or buffer called ``name`` (no grad)."""
    owner_path, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    if attr in owner._parameters:
        owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif attr in owner._buffers:
        owner._buffers[attr] = value
    else:
        raise ModelError(f"{type(model).__name__} has no parameter or buffer {name!r}")


def load_tensors(model: nn.Module, names: list[str], reader: CheckpointReader, device: torch.device,
                 dtype: torch.dtype, optional: set[str] = frozenset()) -> dict[str, str]:
    """Load the named model tensors from the checkpoint; floats cast to ``dtype``.

    Shapes are checked against the skeleton. Returns {model name: checkpoint key}. Names in
    ``optional`` (buffers with a default value, tied weights) may be absent from the checkpoint.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    current = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    found: dict[str, str] = {}
    for name in names:
        key = checkpoint_key(name, reader, prefix)
        if key is None:
            if name in optional:
                continue
            raise ModelError(f"{reader.dir}: checkpoint has no tensor for {name!r} (is a shard missing "
                             f"or the checkpoint for another architecture?)")
        want = list(current[name].shape)
        got = reader.shape(key)
        if got != want:
            raise ModelError(f"{reader.dir}: tensor {key!r} has shape {got} but the model expects {want}")
        t = reader.get(key)
        check_finite(t, f"{reader.path(key)}: tensor {key!r}")
        if t.is_floating_point():
            t = t.to(dtype)
        set_tensor(model, name, t.to(device))
        found[name] = key
    return found


def check_finite(t: torch.Tensor, what: str) -> None:
    """A ModelError naming ``what`` and the first NaN/Inf position if a float tensor has any."""
    if not t.is_floating_point():
        return
    found = first_non_finite(t)
    if found is not None:
        count, kind, first = found
        raise ModelError(f"{what} has {count} non-finite value(s); the first is {kind} at {first}")


def meta_tensors(module: nn.Module) -> list[str]:
    """Names of parameters and buffers still on the meta device."""
    return [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.device.type == "meta"]


def tie_output_embeddings(model: nn.Module) -> bool:
    """If the config ties the output embeddings and the head is still meta, share the input embeddings."""
    cfg = getattr(model, "config", None)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    if not tied or get_out is None or get_in is None:
        return False
    out, inp = get_out(), get_in()
    if out is None or inp is None or not isinstance(getattr(out, "weight", None), torch.Tensor):
        return False
    out.weight = inp.weight
    return True


def is_tied_output(model: nn.Module, name: str) -> bool:
    """Whether module ``name`` is the output embedding tied to the input embeddings."""
    cfg = getattr(model, "config", None)
    if not getattr(cfg, "tie_word_embeddings", False) or not hasattr(model, "get_output_embeddings"):
        return False
    out = model.get_output_embeddings()
    return out is not None and model.get_submodule(name) is out
