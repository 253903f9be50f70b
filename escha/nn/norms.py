"""The RMSNorm before a layer's projections, folded into their input transform.

In a Llama-style decoder layer the residual stream goes through an RMSNorm whose output only the
projections read: ``input_layernorm`` feeds q, k and v, ``post_attention_layernorm`` feeds gate
and up. When those projections are EschaLinears, ``fold_norms`` moves the norm into them: the
norm module becomes a ``FoldedNorm`` that passes its input through (keeping its weight, under the
same name, so the state dict does not change), and each projection applies the norm in its
input transform (``escha.matmul(..., norm=RowNorm)``), which reads every row anyway. With the
projections grouped (``share_inputs``) that is one kernel for the norm and the transform of all
of them instead of the norm's several element-wise kernels before them.

Qwen3's per-head norms of q and k (``q_norm``, ``k_norm``, over 128-wide heads) go into the
projections' output transform the same way (``HEAD_NORMS``): a head is one 128-row Hadamard
block, so one program of the output transform holds each token's head whole.

Only layer classes whose forward is known to feed the norm's output to those projections alone
are folded (``FOLDABLE``, ``HEAD_NORMS``); anything else is left as it is.
"""
from __future__ import annotations

import torch
from torch import nn

from ..norm import HEAD, RowNorm
from .linear import EschaLinear
from .shared import share_inputs

# Decoder layers (transformers class names) whose norms feed only these projections:
# norm attribute -> (block attribute, the block's projections that read the norm's output).
_LLAMA_STYLE = {"input_layernorm": ("self_attn", ("q_proj", "k_proj", "v_proj")),
                "post_attention_layernorm": ("mlp", ("gate_proj", "up_proj"))}
FOLDABLE = {name: _LLAMA_STYLE for name in ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
                                             "Qwen3DecoderLayer")}
_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
# Attention blocks whose per-head norms read only one projection's output:
# block attribute -> ((norm attribute, projection attribute), ...). A head is folded into the
# projection's output transform when it is one 128-row Hadamard block (head_dim 128).
HEAD_NORMS = {"Qwen3DecoderLayer": ("self_attn", (("q_norm", "q_proj"), ("k_norm", "k_proj")))}


class FoldedNorm(nn.Module):
    """An RMSNorm whose readers apply it themselves: forward returns x unchanged.

    Keeps the norm's ``weight`` (same parameter, same state-dict key) and ``variance_epsilon``.
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)

    def row_norm(self) -> RowNorm:
        """The norm, for escha.matmul."""
        return RowNorm(self.weight, self.variance_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, applied by the projections that read it"


def fold_norms(model: nn.Module) -> int:
    """Fold each foldable RMSNorm of ``model`` into the EschaLinears that read it (or, for per-head
    norms, whose output it reads); returns how many.

    A norm is folded when its layer class is in ``FOLDABLE``, it is one of transformers' RMSNorms,
    and every projection reading its output is an EschaLinear (a dense one would get the input
    unnormalised). ``escha.load_model`` calls it after ``share_inputs``.
    """
    folded = 0
    for layer in model.modules():
        folded += _fold_head_norms(layer)
        plan = FOLDABLE.get(type(layer).__name__)
        if plan is None:
            continue
        for norm_name, (block_name, readers) in plan.items():
            norm = getattr(layer, norm_name, None)
            block = getattr(layer, block_name, None)
            if type(norm).__name__ not in _NORMS or block is None:
                continue
            mods = [getattr(block, r, None) for r in readers]
            if not all(isinstance(m, EschaLinear) and m._input_norm is None for m in mods):
                continue
            fn = FoldedNorm(norm)
            setattr(layer, norm_name, fn)
            for m in mods:
                object.__setattr__(m, "_input_norm", fn)
            folded += 1
    return folded


def _fold_head_norms(layer: nn.Module) -> int:
    """Fold the per-head norms of ``layer`` (``HEAD_NORMS``) into their projections' output transform."""
    plan = HEAD_NORMS.get(type(layer).__name__)
    block = None if plan is None else getattr(layer, plan[0], None)
    if block is None:
        return 0
    folded = 0
    for norm_name, proj_name in plan[1]:
        norm, proj = getattr(block, norm_name, None), getattr(block, proj_name, None)
        if (type(norm).__name__ not in _NORMS or not isinstance(proj, EschaLinear) or proj.bias is not None
                or tuple(norm.weight.shape) != (HEAD,) or proj.out_features % HEAD or proj._output_norm is not None):
            continue  # a bias comes before the norm; a head that is not one block is not whole in a program
        fn = FoldedNorm(norm)
        setattr(block, norm_name, fn)
        object.__setattr__(proj, "_output_norm", fn)
        if proj._shared is not None:
            proj._shared.note_norms()
        folded += 1
    return folded


def fuse_projections(model: nn.Module) -> tuple[int, int]:
    """What every loader does to a quantized model before it runs: group the projections quantized
    over one input (``share_inputs``), then fold the RMSNorms before and after them into them
    (``fold_norms``). Returns (groups formed, norms folded)."""
    return share_inputs(model), fold_norms(model)
