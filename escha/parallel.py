"""Tensor parallelism: one Escha checkpoint, split at load time over torch.distributed ranks.

Which layers are split, and how, comes from the model's transformers tensor-parallel plan
(``model.tp_plan``, built from ``config.base_model_tp_plan``): a ``"colwise"`` Linear becomes
column-parallel (its output rows split, no communication), a ``"rowwise"`` Linear row-parallel
(its input columns split, one all-reduce). Fused projections that the plan keeps whole because
transformers would have to gather them (``"colwise_gather_output"`` on Phi-3's ``qkv_proj`` and
``gate_up_proj``, whose consumer is ``"rowwise_split_input"``) are split part by part instead, so
that each rank holds matching slices of q, k and v (or gate and up) and the pair needs one
all-reduce like any other. Every other module (embeddings, norms, lm_head) stays whole on every
rank. Splits follow 128-block boundaries (``escha.format.shard``), so the shards are valid
QuantizedWeights of the one checkpoint: no re-quantization, no per-degree files.

    torchrun --nproc-per-node 2 script.py      # script.py: init_process_group, then
    model = escha.load_model(out_dir, device="cuda")   # each rank reads only its shards
"""
from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .format.qweight import TENSOR_NAMES, FormatError, QuantizedWeight
from .format.shard import ShardError, shard_plan, shard_shape, supported_degrees, take
from .format.spec import HAD_BLOCK, check_bits, padded
from .model.errors import ModelError
from .nn.linear import EschaLinear, replace_linear
from .nn.shared import share_inputs
from .nn.parallel import PARALLEL_CLASSES, ParallelEschaLinear, ParallelLinear, TPGroup

__all__ = ["Placement", "TPGroup", "ShardError", "model_tp_plan", "plan_placements", "parallelize",
           "load_model_parallel", "supported_tp_degrees", "tensor_parallel_active"]

COLUMN = "colwise"
ROW = "rowwise"
#: Plan styles whose module output is whole on every rank, and those whose input is.
GATHERED_OUTPUT = frozenset({"colwise_gather_output", "colwise_rep"})
WHOLE_INPUT = frozenset({"rowwise_split_input", "rowwise_rep"})
#: Integer attributes of an attention module that count heads, divided per rank when it is split.
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


def _qkv_parts(config, out_features: int) -> list[int] | None:
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    parts = [heads * head_dim, kv * head_dim, kv * head_dim]
    return parts if sum(parts) == out_features else None


#: Fused projections split part by part, by leaf name: the parts of the output, or None when
#: the layout does not match. Phi-3 (and Phi-3.5/Phi-4-mini, same architecture) store
#: qkv_proj = [q | k | v] and gate_up_proj = [gate | up].
FUSED_LAYOUTS: dict[str, Callable[[object, int], list[int] | None]] = {
    "qkv_proj": _qkv_parts,
    "gate_up_proj": lambda config, out: [out // 2, out // 2] if out % 2 == 0 else None,
}


@dataclass(frozen=True)
class Placement:
    """How one Linear is split: ``dim`` 0 is column-parallel (output rows), 1 row-parallel (input
    columns); ``parts`` splits a fused output part by part; ``style`` is the plan style it
    implements, as transformers names it (recorded on the model's ``_tp_plan``)."""

    dim: int
    style: str
    parts: tuple[int, ...] | None = None


def tensor_parallel_active(group: dist.ProcessGroup | None = None) -> bool:
    """Whether an initialised torch.distributed group of more than one rank is present."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan, keyed by module names with ``*`` for layer indices.

    transformers 5 merges ``config.base_model_tp_plan`` and the heads' plans into ``model.tp_plan``
    with full names; older versions keep only the config's, relative to the base model.
    """
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    if prefix and hasattr(model, prefix) and getattr(model, prefix) is not model:
        return {f"{prefix}.{k}": v for k, v in base.items()}
    return dict(base)


def _generic(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _style(plan: dict[str, str], name: str) -> str | None:
    return plan.get(name, plan.get(_generic(name)))


def plan_placements(model: nn.Module) -> dict[str, Placement]:
    """Which Linear layers of ``model`` are split, and how, from its tensor-parallel plan.

    Raises ModelError when the model has no plan or the plan splits a module that is not a
    Linear. The result does not depend on the world size; ``shard_plan`` checks that later.
    """
    plan = model_tp_plan(model)
    if not plan:
        raise ModelError(f"{type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan), "
                         f"so escha cannot tell which layers to split")
    modules = dict(model.named_modules())
    styles = {n: s for n in modules if (s := _style(plan, n)) is not None}
    linear = (nn.Linear, EschaLinear)
    placements: dict[str, Placement] = {}
    fused_parents: set[str] = set()
    for name, style in styles.items():
        mod = modules[name]
        if style in (COLUMN, ROW):
            if not isinstance(mod, linear):
                raise ModelError(f"the tensor-parallel plan splits {name} ({type(mod).__name__}) {style!r}; "
                                 f"escha splits only Linear layers")
            placements[name] = Placement(0 if style == COLUMN else 1, style)
            continue
        parent, _, leaf = name.rpartition(".")
        layout = FUSED_LAYOUTS.get(leaf)
        if style in GATHERED_OUTPUT and layout is not None and isinstance(mod, linear):
            parts = layout(_text_config(model), mod.out_features)
            consumers = [n for n in styles if n.rpartition(".")[0] == parent and styles[n] in WHOLE_INPUT]
            if parts is not None and consumers:
                # Split part by part rather than gather: the output then holds this rank's heads
                # (or gate and up slices) and its consumer takes it as a row-parallel input.
                placements[name] = Placement(0, COLUMN if leaf == "qkv_proj" else "packed_colwise", tuple(parts))
                fused_parents.add(parent)
    for name, style in styles.items():
        if style in WHOLE_INPUT and name.rpartition(".")[0] in fused_parents and isinstance(modules[name], linear):
            placements[name] = Placement(1, ROW)
    return placements


#: Which head counts of the config a split projection's output holds, by leaf name.
HEAD_COUNTS = {"q_proj": ("num_attention_heads",), "k_proj": ("num_key_value_heads",),
               "v_proj": ("num_key_value_heads",), "qkv_proj": ("num_attention_heads", "num_key_value_heads")}


def _check_heads(model: nn.Module, placements: dict[str, Placement], world_size: int) -> None:
    """Each rank must hold the same whole number of heads of every split attention projection."""
    cfg = _text_config(model)
    for name, p in placements.items():
        parent_name, _, leaf = name.rpartition(".")
        head_dim = getattr(model.get_submodule(parent_name) if parent_name else model, "head_dim", None)
        if p.dim != 0 or not isinstance(head_dim, int):
            continue
        for what in HEAD_COUNTS.get(leaf, ()):
            n = getattr(cfg, what, None)
            if what == "num_key_value_heads" and n is None:
                n = getattr(cfg, "num_attention_heads", None)
            if isinstance(n, int) and n % world_size:
                raise ModelError(f"{what}={n} does not divide by {world_size} ranks: tensor parallelism splits "
                                 f"attention by whole heads")
        out = model.get_submodule(name).out_features
        for rank in range(world_size):
            ranges = shard_plan((out, 1), 0, rank, world_size, p.parts).ranges
            for (a, b), size in zip(ranges, p.parts or (out,)):
                if (b - a) * world_size != size or (b - a) % head_dim:
                    raise ModelError(f"{name}: rank {rank} would hold rows {a}..{b} of a {size}-row projection, "
                                     f"not an equal share of whole {head_dim}-wide heads")


class _RankConfig:
    """A model config as one rank's attention module sees it: its share of the heads.

    Reads fall through to the model's config (so later changes, e.g. the attention
    implementation, still apply); only the head counts differ.
    """

    def __init__(self, base, **local: int) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_local", local)

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy/pickle protocol lookups must not reach the shared config
            raise AttributeError(name)
        local = object.__getattribute__(self, "_local")
        return local[name] if name in local else getattr(object.__getattribute__(self, "_base"), name)


def _localize_attention(model: nn.Module, placements: dict[str, Placement], world_size: int) -> None:
    """Give each split attention module its per-rank head counts.

    transformers' attention reshapes with -1 heads, so separate q/k/v projections need nothing;
    head-count attributes (``num_key_value_heads``...) and, for a fused qkv_proj, the config's
    counts (Phi-3 slices [q | k | v] with them) are set to this rank's share.
    """
    cfg = _text_config(model)
    for parent_name in {n.rpartition(".")[0] for n, p in placements.items() if p.dim == 0}:
        parent = model.get_submodule(parent_name) if parent_name else model
        if not isinstance(getattr(parent, "head_dim", None), int):
            continue
        for attr in HEAD_ATTRIBUTES:
            value = parent.__dict__.get(attr)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(parent, attr, value // world_size)
        fused = any(p.parts is not None and n.rpartition(".")[0] == parent_name for n, p in placements.items())
        if fused and hasattr(parent, "config"):
            local = {k: getattr(cfg, k) // world_size for k in ("num_attention_heads", "num_key_value_heads")
                     if isinstance(getattr(cfg, k, None), int)}
            parent.config = _RankConfig(parent.config, **local)


def _record_plan(model: nn.Module, placements: dict[str, Placement], tp: TPGroup) -> None:
    # transformers sizes a StaticCache per rank from these (get_kv_heads_per_rank reads "colwise"
    # key projections and _tp_size); only the splits escha made are listed.
    model._tp_plan = {_generic(n): p.style for n, p in placements.items()}
    model._tp_size = tp.world_size
    model.escha_tp = tp


def _prepare(model: nn.Module, tp: TPGroup) -> dict[str, Placement]:
    placements = plan_placements(model)
    for name, p in placements.items():  # every split is checked before anything changes
        mod = model.get_submodule(name)
        try:
            shard_plan((mod.out_features, mod.in_features), p.dim, tp.rank, tp.world_size, p.parts)
        except ShardError as e:
            raise ShardError(f"{name}: {e}") from None
    _check_heads(model, placements, tp.world_size)
    return placements


def parallelize(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Split a whole model held in memory on every rank into this rank's shards, in place.

    For a model quantized in memory (``quantize_module``) or built with random weights (the
    benchmarks); ``escha.load_model`` under torchrun does the same while reading only the shards.
    """
    tp = TPGroup.current(group)
    placements = _prepare(model, tp)
    for name, p in placements.items():
        mod = model.get_submodule(name)
        cls = PARALLEL_CLASSES[(isinstance(mod, EschaLinear), p.dim)]
        if isinstance(mod, EschaLinear):
            new = cls.from_full(mod.qweight, mod.bias, tp, p.parts)
            new.path, new.precision = mod.path, mod.precision
            if mod._input_norm is not None or mod._output_norm is not None:  # folded norms (fold_norms)
                if p.dim != 0:  # read whole input rows or whole heads: only a row split keeps them
                    raise ModelError(f"{name} applies a folded RMSNorm but is split along its input")
                object.__setattr__(new, "_input_norm", mod._input_norm)
                object.__setattr__(new, "_output_norm", mod._output_norm)
        else:
            new = cls.from_full(mod, tp, p.parts)
        replace_linear(model, name, new)
    _localize_attention(model, placements, tp.world_size)
    _record_plan(model, placements, tp)
    share_inputs(model)  # this rank's q/k/v (gate/up) shards, as one product again
    return model


def _skeleton_modules(model: nn.Module, placements: dict[str, Placement], tp: TPGroup) -> None:
    """Replace each split Linear of a meta skeleton by its parallel class, at local shapes."""
    for name, p in placements.items():
        mod = model.get_submodule(name)
        has_bias = mod.bias is not None
        if isinstance(mod, EschaLinear):
            new = PARALLEL_CLASSES[(True, p.dim)](mod.in_features, mod.out_features, bias=has_bias, tp=tp,
                                                 parts=p.parts, bits=mod.bits, device="meta",
                                                 dtype=mod.bias.dtype if has_bias else None)
        else:
            new = PARALLEL_CLASSES[(False, p.dim)](mod.in_features, mod.out_features, bias=has_bias, tp=tp,
                                                  parts=p.parts, device="meta", dtype=mod.weight.dtype)
        replace_linear(model, name, new)


_ST_DTYPES = {"I32": torch.int32, "I8": torch.int8, "F16": torch.float16, "F32": torch.float32}


def _read_quantized(f, path: str, name: str, entry: dict, mod: nn.Module) -> QuantizedWeight:
    """The weight ``name`` as ``mod`` holds it: this rank's block slices, or all of it."""
    shape, bits = tuple(entry["shape"]), entry["bits"]
    try:
        check_bits(bits)
    except ValueError as e:
        raise FormatError(f"{path}: {name!r}: {e}") from None
    np_, kp = padded(shape[0]), padded(shape[1])
    slices = {}
    for spec in QuantizedWeight.TENSORS:
        key = f"{name}.{spec.name}"
        sl = f.get_slice(key)
        want = spec.shape(np_, kp, bits)
        if tuple(sl.get_shape()) != want or _ST_DTYPES.get(sl.get_dtype()) != spec.dtype:
            raise FormatError(f"{path}: {key} must be {spec.dtype} {list(want)} for shape {list(shape)} K={bits}, "
                              f"got {sl.get_dtype()} {sl.get_shape()}")
        slices[spec.name] = sl
    if isinstance(mod, ParallelEschaLinear):
        if mod.global_shape != shape:
            raise ModelError(f"{path}: {name!r} is {list(shape)} but the model expects {list(mod.global_shape)}")
        tensors = [take(spec, mod.shard, slices[spec.name].__getitem__) for spec in QuantizedWeight.TENSORS]
        shape = shard_shape(shape, mod.shard)
    else:
        tensors = [f.get_tensor(f"{name}.{spec.name}") for spec in QuantizedWeight.TENSORS]
    try:
        return QuantizedWeight(*tensors, shape=shape, bits=bits, codebook_id=entry["codebook"],
                               had_block=entry.get("had_block", HAD_BLOCK))
    except FormatError as err:
        raise FormatError(f"{path}: {name!r}: {err}") from None


def _read_dense(f, path: str, key: str, mod: nn.Module | None, attr: str) -> torch.Tensor:
    """A plain tensor: a split dense layer's weight (or a column-split bias) as its rows/columns."""
    if not isinstance(mod, (ParallelLinear, ParallelEschaLinear)) or attr not in ("weight", "bias"):
        return f.get_tensor(key)
    dim = mod.PARALLEL_DIM
    if attr == "bias" and dim == 1:
        return f.get_tensor(key)  # a row-parallel bias is added once, after the all-reduce
    sl = f.get_slice(key)
    want = [mod.global_shape[0]] if attr == "bias" else list(mod.global_shape)
    if list(sl.get_shape()) != want:
        raise ModelError(f"{path}: tensor {key!r} has shape {sl.get_shape()} but the model expects {want}")
    pieces = []
    for a, b in mod.shard.ranges:
        index = [slice(None)] * len(want)
        index[dim] = slice(a, b)
        pieces.append(sl[tuple(index)])
    return torch.cat(pieces, dim=dim).contiguous()


def load_local(model_dir: str | os.PathLike, tp: TPGroup, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> nn.Module:
    """Rank ``tp.rank``'s model: the split layers hold only their shards, read as byte ranges.

    No collective runs here (``load_model_parallel`` adds the ranks' agreement around it), so a
    rank's model can be built in any process, e.g. to inspect it.
    """
    from safetensors import safe_open

    from .io import _parse_meta, read_header
    from .model.checkpoint import set_tensor
    from .devices import resolve_device
    from .model.loading import (_shards, check_belongs, check_complete, escha_skeleton, finish, in_dtype,
                                 quantized_target)

    model_dir = os.fspath(model_dir)
    device = resolve_device(device)
    model = escha_skeleton(model_dir, dtype)
    files = _shards(model_dir)
    placements = _prepare(model, tp)
    _skeleton_modules(model, placements, tp)
    expected = set(model.state_dict().keys())
    for path in files:
        header = read_header(path)
        entries = _parse_meta(path, header)
        stored = set(header) - {"__metadata__"}
        with safe_open(path, framework="pt", device="cpu") as f:
            used: set[str] = set()
            for name, entry in entries.items():
                keys = [f"{name}.{p}" for p in TENSOR_NAMES]
                missing = [k for k in keys if k not in stored]
                if missing:
                    raise FormatError(f"{path}: quantized weight {name!r} is missing {missing}")
                mod = quantized_target(model, path, name, entry["bits"])
                mod.set_qweight(_read_quantized(f, path, name, entry, mod).to(device))
                used.update(keys)
            for key in sorted(stored - used):
                check_belongs(model, expected, path, key)
                owner, _, attr = key.rpartition(".")
                t = _read_dense(f, path, key, model.get_submodule(owner) if owner else model, attr)
                set_tensor(model, key, in_dtype(t, dtype).to(device))
    check_complete(model, model_dir)
    model.to(device)
    _localize_attention(model, placements, tp.world_size)
    _record_plan(model, placements, tp)
    return finish(model, model_dir)


def _fingerprint(model_dir: str) -> str:
    """What every rank must agree on: config.json, the index and the shard files' names and sizes."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        p = os.path.join(model_dir, name)
        if os.path.isfile(p):
            with open(p, "rb") as fh:
                h.update(name.encode() + b"\0" + fh.read())
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            h.update(f"{name}:{os.path.getsize(os.path.join(model_dir, name))}".encode())
    return h.hexdigest()[:16]


_CONTROL: dict = {}


def _control_group(tp: TPGroup, timeout: datetime.timedelta | None) -> dist.ProcessGroup | None:
    """A gloo group over the TP ranks for the loaders' bookkeeping.

    Object collectives on NCCL need each rank's CUDA device set and end a timed-out rank by
    aborting the process; on gloo they raise, so an error stays an exception on every rank.
    """
    if dist.get_backend(tp.group) == "gloo":
        return tp.group
    if tp.group not in _CONTROL:  # new_group is collective: every rank creates it at the same call
        ranks = None if tp.group is None else dist.get_process_group_ranks(tp.group)
        _CONTROL[tp.group] = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    return _CONTROL[tp.group]


def _agree(tp: TPGroup, mine: tuple[str | None, str | None], what: str,
           timeout: datetime.timedelta | None = None) -> list:
    """Exchange (fingerprint, error) between the ranks; raise on every rank if any failed or differed."""
    every: list = [None] * tp.world_size
    dist.all_gather_object(every, mine, group=_control_group(tp, timeout))
    failed = [(r, err) for r, (_, err) in enumerate(every) if err is not None]
    prints = {fp for fp, _ in every if fp is not None}
    if len(prints) > 1:
        seen = ", ".join(f"rank {r}: {fp}" for r, (fp, _) in enumerate(every))
        raise ModelError(f"ranks are loading different checkpoints for {what} ({seen}); every rank must "
                         f"read the same directory")
    if failed:
        r, err = failed[0]
        raise ModelError(f"rank {r} of {tp.world_size} failed to load {what}: {err}")
    return every


def load_model_parallel(model_dir: str | os.PathLike, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None,
                        timeout: datetime.timedelta | None = None) -> nn.Module:
    """``load_model`` for one rank of a tensor-parallel group (``escha.load_model`` calls it
    inside an initialised process group of more than one rank).

    Every rank reads only its shards and returns a model whose forward and ``.generate`` give
    the single-process model's results (up to the order of the all-reduce's sums). The ranks
    first check that they read the same checkpoint and finally that all of them loaded it; an
    error on any rank is raised on every rank (the failing rank raises its own), so none is left
    waiting in a collective. That exchange runs on gloo: on ``group`` itself when it is gloo
    (its timeout applies), else on a gloo group over the same ranks made at the first call, which
    waits ``timeout`` (None: torch's default, 30 minutes) for a rank that never arrives.
    """
    tp = TPGroup.current(group)
    model_dir = os.fspath(model_dir)
    try:
        fp, err = _fingerprint(model_dir), None
    except OSError as e:
        fp, err = None, f"{type(e).__name__}: {e}"
    _agree(tp, (fp, err), model_dir, timeout)
    model, failure = None, None
    try:
        model = load_local(model_dir, tp, device, dtype)
    except Exception as e:  # every rank must reach the agreement below, whatever went wrong
        failure = e
    try:
        _agree(tp, (fp, None if failure is None else f"{type(failure).__name__}: {failure}"), model_dir, timeout)
    except Exception:
        if failure is not None:
            raise failure from None
        raise
    return model


def supported_tp_degrees(model: nn.Module | str | os.PathLike) -> list[int]:
    """The world sizes a checkpoint (a directory written by ``escha quantize``) or a model can be
    split over: every degree that divides each split dimension's 128-blocks (part by part for
    fused layers) and gives every rank whole attention heads."""
    if not isinstance(model, nn.Module):
        from .model.loading import escha_skeleton
        model = escha_skeleton(os.fspath(model), None)
    placements = plan_placements(model)
    degrees: set[int] | None = None
    for name, p in placements.items():
        mod = model.get_submodule(name)
        ok = set(supported_degrees((mod.out_features, mod.in_features)[p.dim], p.parts))
        degrees = ok if degrees is None else degrees & ok
    out = []
    for d in sorted(degrees or {1}):
        try:
            _check_heads(model, placements, d)
        except ValueError:
            continue
        out.append(d)
    return out
