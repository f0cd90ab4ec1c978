"""The one object that says what a model's blocks compute with besides torch's own ops (the review's F6: no kernel
slots filled into module instances from above).

A model is given its `Backend` when it is built (`Architecture.build`), and hands the same object to every block it
makes; a block asks it at each call (`backend.rms_norm`, `backend.router_topk`, `backend.attention`: None where torch's
ops compute). Once the model's weights are in place, the builder calls `backend.fuse(model)` (loading/build.py):
the backend makes the fused decode calls it has for the model's layers and for the whole model (`layer_steps`,
`model_step`), which the layers and the model then try first. This base class is torch's ops alone; accel/step.py's
`KernelBackend` is moepager's CPU kernels for a bf16 model on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn


class StepKernels(Protocol):
    """What an attention layer's decode pass calls on the CPU kernels (accel/ops.py `Kernels`)."""

    decode_attention: Callable[..., torch.Tensor]


NormKernel = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""rms_norm(x, weight, eps): a bf16 RMSNorm in one call."""
RouterKernel = Callable[[torch.Tensor, torch.Tensor, int, bool], list[torch.Tensor]]
"""router_topk(x_ND, weight_ED, k, normalize) -> [ids_NK, weights_NK, probs_NE]: a softmax top-k router in one call."""
FusedStep = Callable[..., "torch.Tensor | None"]
"""A fused decode call (a decoder layer's or the whole model's): its output, or None where it declines (the modules
compute)."""


class Backend:
    """torch's own ops for every block: no kernel, no fused call (what a model built without a backend gets).

    Subclasses set the kernels they have for the run's dtype and device, and make fused calls in `fuse`. Every kernel
    computes the arithmetic of the torch path it replaces up to its last bits (accel/step.py says how far); blocks use
    one only outside a compiled graph, for the inputs its contract names."""

    name = "torch's ops"

    def __init__(self) -> None:
        self.rms_norm: NormKernel | None = None
        """For bf16 inputs: every RMSNorm (the q/k norms' per-head weight too)."""
        self.router_topk: RouterKernel | None = None
        """For up to moe.NATIVE_MAX_TOKENS bf16 tokens: every softmax top-k router."""
        self.attention: StepKernels | None = None
        """For a decode pass (one token a row) over the paged cache: every grouped-query attention layer's q/k norm,
        RoPE, cache write and attention in one call."""
        self.layer_steps: dict[nn.Module, FusedStep] = {}
        """A decoder layer's whole decode pass in one call, by layer (made by `fuse`)."""
        self.model_step: FusedStep | None = None
        """The whole model's decode pass in one call, embedding to logits (made by `fuse`)."""

    def fuse(self, model: nn.Module) -> str:
        """Make the fused decode calls this backend has for `model` (a CausalLM whose weights are in place, on their
        device and in their final modules) into `layer_steps` and `model_step`; say what the model computes with
        ("" for torch's ops alone)."""
        return ""
