"""A frozen NVFP4 Linear layer: packed weight buffers, an autograd Function that runs the
fused Triton kernels on CUDA, a decoded weight kept for the dense matmul elsewhere, and no
weight gradient."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from qerl.formats import nvfp4
from qerl.formats.nvfp4_checkpoint import NVFP4Checkpoint
from qerl.kernels import device_facts as facts
from qerl.kernels import nvfp4_layout as layout
from qerl.kernels import nvfp4_matmul as kernels


def _use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda or facts.interpreting()


class NVFP4LinearFunction(torch.autograd.Function):
    """y = x @ deq(W)^T + b by the kernels; gradients flow to x (and a trainable bias),
    never to W."""

    @staticmethod
    def forward(ctx, x, pairs, scale, global_scale, bias):
        ctx.save_for_backward(pairs, scale, global_scale)
        ctx.bias_needs_grad = bias is not None and bias.requires_grad
        return kernels.nvfp4_linear(x, pairs, scale, global_scale, bias)

    @staticmethod
    def backward(ctx, dy):
        pairs, scale, global_scale = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = kernels.nvfp4_linear_grad_input(dy.contiguous(), pairs, scale, global_scale)
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.bias_needs_grad else None
        return dx, None, None, None, dbias


class NVFP4Linear(nn.Module):
    """``nn.Linear`` with a frozen NVFP4 weight. Buffers: ``weight_pairs``, the codes in the
    kernels' pair-interleaved tiles (permuted once, here, from the checkpoint's
    ``weight_packed``, which ``packed_weight`` gives back), and ``weight_scale`` and
    ``weight_global_scale`` as in compressed-tensors checkpoints.

    Where no kernel runs (a CPU), the layer multiplies by its dequantized weight and keeps
    that weight (``decoded_weight``) for its next call: decoding the whole weight again at
    every call, a decode step's every projection, was most of a CPU rollout's time. So on
    a CPU the layer holds a dense weight beside its codes, as much memory as the dense
    Linear; the format's saving is the GPU's, whose kernels read the codes alone."""

    def __init__(self, weight: nvfp4.NVFP4Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_pairs", layout.to_pairs(weight.packed))
        self.register_buffer("weight_scale", weight.scale)
        self.register_buffer("weight_global_scale", weight.global_scale)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self._decoded: tuple[tuple, torch.Tensor] | None = None  # (its stamp, the weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, global_scale: torch.Tensor | None = None,
                    name: str = "weight") -> NVFP4Linear:
        """Quantize a Linear (optionally with a global scale shared with fused layers)."""
        weight = nvfp4.quantize(linear.weight.detach(), global_scale, name)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        return cls(weight, bias)

    @classmethod
    def from_checkpoint(cls, checkpoint: NVFP4Checkpoint, module: str) -> NVFP4Linear:
        """The layer ``module`` (e.g. model.layers.0.mlp.up_proj) of a loaded checkpoint."""
        return cls(checkpoint.quantized[module], checkpoint.dense.get(f"{module}.bias"))

    @property
    def qweight(self) -> torch.Tensor:
        """The packed codes under the name PEFT (and GPTQ-style code) looks for to find a
        quantized layer's device; integer, so adapters keep their own dtype."""
        return self.weight_pairs

    @property
    def packed_weight(self) -> nvfp4.NVFP4Tensor:
        """The weight in compressed-tensors' packing."""
        packed = layout.from_pairs(self.weight_pairs, self.out_features, self.in_features)
        return nvfp4.NVFP4Tensor(packed, self.weight_scale, self.weight_global_scale)

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return nvfp4.dequantize(self.packed_weight, dtype)

    def _stamp(self, dtype: torch.dtype) -> tuple | None:
        """What the decoded weight depends on: the buffers themselves (replaced by ``.to``
        or an assignment), their storage (a ``.data`` swap) and their version counters
        (bumped by every in-place write, ``load_state_dict``'s copy among them). None for
        inference tensors, which keep no version counter: those are decoded at every call."""
        sources = (self.weight_pairs, self.weight_scale, self.weight_global_scale)
        if any(t.is_inference() for t in sources):
            return None
        return (dtype, *((t, t.data_ptr(), t._version) for t in sources))

    def decoded_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``dequantized_weight(dtype)``, decoded once and kept while the codes and scales
        it came from are unchanged (read only: it is the layer's own copy)."""
        stamp = self._stamp(dtype)
        if stamp is None:
            return self.dequantized_weight(dtype)
        if self._decoded is None or not _same_stamp(self._decoded[0], stamp):
            self._decoded = None  # the stale copy freed before the new one is made
            self._decoded = (stamp, self.dequantized_weight(dtype))
        return self._decoded[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if not _use_kernels(x):  # autograd's own matmul gives x (and the bias) its gradient
            return F.linear(x, self.decoded_weight(x.dtype), bias)
        return NVFP4LinearFunction.apply(x, self.weight_pairs, self.weight_scale,
                                         self.weight_global_scale, bias)

    def partial_sums(self, x2: torch.Tensor) -> torch.Tensor:
        """Inference on rows x2 [M, K]: [S, M, N] whose sum over S, rounded to x's dtype,
        is ``forward(x2)`` — the fused kernel's split-K partials where it runs (a consumer
        that reduces anyway saves a launch), else the result itself as [1, M, N]."""
        return grouped_partial_sums([self], x2)[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format=nvfp4")


def _same_stamp(a: tuple, b: tuple) -> bool:
    """Stamps alike: one dtype, and per buffer the same tensor object (not merely an equal
    one), storage and version."""
    return a[0] == b[0] and all(x[0] is y[0] and x[1:] == y[1:]
                                for x, y in zip(a[1:], b[1:], strict=True))


def grouped_partial_sums(layers: list[NVFP4Linear], x2: torch.Tensor) -> list[torch.Tensor]:
    """``partial_sums`` of layers that read the same rows (q/k/v, gate/up): one kernel
    launch for all of them where the CUDA kernel or the Hopper GEMM runs."""
    if _use_kernels(x2) and x2.shape[0] <= kernels.FUSED_MAX_M:
        return kernels.nvfp4_linear_grouped_partials(x2.contiguous(), _weights(layers, x2))
    if _use_kernels(x2):
        outs = kernels.nvfp4_linear_grouped(x2.contiguous(), _weights(layers, x2))
        if outs is not None:
            return [out[None] for out in outs]
    return [layer(x2)[None] for layer in layers]


def grouped_partial_sums_and_shrink(layers: list[NVFP4Linear], x2: torch.Tensor,
                                    lora_a: list[torch.Tensor]
                                    ) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """``grouped_partial_sums`` and the layers' LoRA shrink (fp32 adapters A_g) in one
    launch: (partial sums, xa [S, M, G * R] whose sum over S is x2 @ A_g^T side by side),
    or None where the CUDA kernel does not run this group."""
    if not (x2.is_cuda and x2.shape[0] <= kernels.FUSED_MAX_M):
        return None
    return kernels.nvfp4_linear_grouped_partials_and_shrink(x2.contiguous(),
                                                            _weights(layers, x2), lora_a)


def _weights(layers: list[NVFP4Linear], x2: torch.Tensor) -> list[tuple]:
    return [(layer.weight_pairs, layer.weight_scale, layer.weight_global_scale,
             None if layer.bias is None else layer.bias.to(x2.dtype)) for layer in layers]
