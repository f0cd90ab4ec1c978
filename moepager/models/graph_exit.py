"""What a compiled graph leaves for eager code: MoE layers (`moepager::moe_layer`) and projections with opaque
weights (`moepager::opaque_linear`).

A paged layer cannot be traced: which experts are resident, which must load and when they land is decided on the
host, per token. So the compiled decode step (accel/compiled.py) of a paged model keeps everything else in its
graph (attention, norms, the router, shared experts) and calls this operator where each MoE block's routed experts
run: its kernel looks the block up by the handle `register` gave it and runs the block's `host_step` (observers,
then the expert executor), eagerly. For Inductor the operator is opaque: a fake kernel gives its output's shape
(x's), and the graph around it compiles whole (`fullgraph`), with no graph break per layer.

Dense projections whose weights are opaque objects Dynamo cannot trace leave the same way, through `opaque_linear`
(`LeavesGraph` modules: oneDNN-prepacked bf16, accel/packed.py, and FBGEMM-prepacked int8, accel/dense_quant.py);
without the exit a compiled step would have to compute them from plain weights (slower on a large model's matrices)
or not compile at all.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Protocol

import torch
from torch import nn

from moepager.types import RoutingDecision


class HostStep(Protocol):
    def host_step(self, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        """The routed experts' output for x_ND under `route`, computed on the host's schedule."""
        ...


class LeavesGraph(nn.Module):
    """A projection whose weights are opaque (prepacked objects): once `register_linear` gave it a handle, a compiled
    graph calls it through `opaque_linear`; eagerly, and before, it runs `host_linear` directly."""

    out_features: int
    graph_exit: int | None = None
    opaque_weights = True
    """False for a subclass whose weights are plain tensors (the graph traces it; it is never registered)."""

    def host_linear(self, x: torch.Tensor) -> torch.Tensor:
        """The projection of x (any leading dimensions)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.graph_exit is not None and torch.compiler.is_compiling():
            return opaque_linear(x, self.graph_exit)
        return self.host_linear(x)


_BLOCKS: weakref.WeakValueDictionary[int, HostStep] = weakref.WeakValueDictionary()
_LINEARS: weakref.WeakValueDictionary[int, LeavesGraph] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()
"""Handles count up from 0 in each process, so a model compiled again in a new process traces the same constants
and Inductor's cache on disk finds its graph (an address would differ every time)."""



def register(block: HostStep) -> int:
    """The handle a compiled graph passes to `moe_layer` to run `block` (kept while the block lives)."""
    _operators()
    _BLOCKS[handle := next(_HANDLES)] = block
    return handle


def register_linear(module: LeavesGraph) -> int:
    """The handle a compiled graph passes to `opaque_linear` to run `module` (kept while the module lives)."""
    _operators()
    _LINEARS[handle := next(_HANDLES)] = module
    return handle


def moe_layer(x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor, scores_NE: torch.Tensor,
              block: int) -> torch.Tensor:
    """The registered `block`'s host step, as one opaque operator in a compiled graph."""
    return torch.ops.moepager.moe_layer(x_ND, ids_NK, weights_NK, scores_NE, block)


def opaque_linear(x: torch.Tensor, module: int) -> torch.Tensor:
    """The registered `module`'s projection of x, as one opaque operator in a compiled graph."""
    return torch.ops.moepager.opaque_linear(x, module)


def _moe_layer(x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor, scores_NE: torch.Tensor,
               block: int) -> torch.Tensor:
    return _BLOCKS[block].host_step(x_ND, RoutingDecision(ids_NK, weights_NK, scores_NE))


def _shape_only(x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor, scores_NE: torch.Tensor,
                block: int) -> torch.Tensor:
    return torch.empty_like(x_ND)


def _opaque_linear(x: torch.Tensor, module: int) -> torch.Tensor:
    return _LINEARS[module].host_linear(x)


def _projected_shape(x: torch.Tensor, module: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _LINEARS[module].out_features))


@functools.cache
def _operators() -> torch.library.Library:
    """Define the two operators, once per process: at the first registration, not when this module is imported
    (STYLE rule 6). The handle registries above are process-wide for the same reason the operators are: a compiled
    graph can carry only a constant to find its block by."""
    lib = torch.library.Library("moepager", "FRAGMENT")
    lib.define("moe_layer(Tensor x_ND, Tensor ids_NK, Tensor weights_NK, Tensor scores_NE, int block) -> Tensor")
    lib.define("opaque_linear(Tensor x, int module) -> Tensor")
    lib.impl("moe_layer", _moe_layer, "CompositeExplicitAutograd")
    torch.library.register_fake("moepager::moe_layer", _shape_only, lib=lib)
    lib.impl("opaque_linear", _opaque_linear, "CompositeExplicitAutograd")
    torch.library.register_fake("moepager::opaque_linear", _projected_shape, lib=lib)
    return lib
