"""RowNorm: the RMSNorm in front of a layer, which escha.matmul can apply to x before the product.

A decoder layer normalises the residual stream just before its q/k/v and its gate/up projections
(``input_layernorm``, ``post_attention_layernorm`` in Llama, Mistral and Qwen). When those
projections run as one product (escha.nn.share_inputs), the norm can go into the product's
input transform, which reads every row anyway: ``escha.nn.fold_norms`` does that, and
``escha.matmul(x, qw, norm=RowNorm(weight, eps))`` computes ``norm(x) @ W_hat^T``.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .format.spec import HAD_BLOCK


@dataclass(frozen=True)
class RowNorm:
    """y = weight * dtype(x * rsqrt(mean(x**2, -1) + eps)), the row RMSNorm of Llama-style models."""

    weight: torch.Tensor  # [in_features]
    eps: float

    def __post_init__(self) -> None:
        if not isinstance(self.weight, torch.Tensor) or self.weight.dim() != 1:
            raise TypeError("RowNorm.weight must be a 1-D tensor")
        if isinstance(self.eps, bool) or not isinstance(self.eps, numbers.Real):
            raise TypeError(f"RowNorm.eps must be a float, got {type(self.eps).__name__}")
        if not self.eps >= 0:
            raise ValueError(f"RowNorm.eps must be non-negative, got {self.eps!r}")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The norm as the model computes it (transformers' LlamaRMSNorm), in PyTorch."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def fusable(self, x: torch.Tensor) -> bool:
        """Whether a kernel's input transform can apply it to x: a weight of x's dtype and width
        on x's device (then the result keeps x's dtype, as ``apply`` gives it)."""
        return (self.weight.dtype == x.dtype and self.weight.device == x.device
                and self.weight.shape[0] == x.shape[-1] and self.weight.is_contiguous())


HEAD = HAD_BLOCK  # the head width a HeadNorm normalises: one Hadamard block


@dataclass(frozen=True)
class HeadNorm:
    """The RMSNorm over each attention head of a projection's output (Qwen3's q_norm, k_norm), for
    outputs whose heads are 128-row blocks: block b of the padded output is normalised when
    ``blocks[b]`` is nonzero, with the weights ``weight[128 b : 128 (b + 1)]``.

    y_head = weight * dtype(h * rsqrt(mean(h**2) + eps)), h = float(dtype(y_head)): the model's
    norm of the projection's output as the projection returns it.
    """

    weight: torch.Tensor  # [Np]: each normalised block's norm weight (any values elsewhere)
    blocks: torch.Tensor  # int8 [Np / 128]: 1 where the block is a normalised head
    eps: float

    def __post_init__(self) -> None:
        if not isinstance(self.weight, torch.Tensor) or not isinstance(self.blocks, torch.Tensor):
            raise TypeError("HeadNorm.weight and HeadNorm.blocks must be tensors")
        if self.weight.dim() != 1 or self.weight.shape[0] % HEAD:
            raise ValueError(f"HeadNorm.weight must be 1-D, whole {HEAD}-row blocks; got {list(self.weight.shape)}")
        if tuple(self.blocks.shape) != (self.weight.shape[0] // HEAD,):
            raise ValueError(f"HeadNorm.blocks must hold one flag a block, [{self.weight.shape[0] // HEAD}]; got "
                             f"{list(self.blocks.shape)}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, numbers.Real):
            raise TypeError(f"HeadNorm.eps must be a float, got {type(self.eps).__name__}")
        if not self.eps >= 0:
            raise ValueError(f"HeadNorm.eps must be non-negative, got {self.eps!r}")

    def fusable(self, y: torch.Tensor) -> bool:
        """Whether a kernel's output transform can apply it to y: weights of y's dtype and int8
        flags, contiguous, on y's device."""
        return (self.weight.dtype == y.dtype and self.blocks.dtype == torch.int8 and self.weight.device == y.device
                and self.weight.is_contiguous() and self.blocks.is_contiguous())

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        """The norm applied to y [..., out] in PyTorch (y's dtype), as the model computes it; every
        block is computed and the flags select, so nothing here waits for the host."""
        out, np_ = y.shape[-1], self.weight.shape[0]
        y2 = torch.nn.functional.pad(y.reshape(-1, out), (0, np_ - out)).view(-1, np_ // HEAD, HEAD)
        h = y2.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight.view(-1, HEAD) * h.to(y.dtype)
        y2 = torch.where(self.blocks.view(-1, 1).to(torch.bool), normed.to(y.dtype), y2)
        # Contiguous, like the kernels' outputs and escha.matmul's fake output (cropping leaves a view).
        return y2.reshape(-1, np_)[:, :out].reshape(y.shape).contiguous()

