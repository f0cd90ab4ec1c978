"""A compiled decode step (`--compile`; CPU; opt-in): one token a row, one row or several.

A small model's decode step is bound by per-call overhead, not bytes: the built-in model runs hundreds of aten calls per
token eagerly, where llama.cpp runs its whole graph in one. `compile_decode` hands the model's forward to TorchInductor,
whole (`fullgraph`: the router, the experts and attention in one graph, no break per layer), with its C++ wrapper
(kernels called from C++, not Python). Elementwise chains (RMSNorm, RoPE, SwiGLU, the router's softmax) fuse into
generated loops; GEMMs stay torch's own. Shapes are static at the first compile, and Dynamo's automatic dynamic shapes
make the KV length dynamic at the second decode and the block table's width at the first new block (two more compiles,
then one graph for every length; runtime/runner.py passes a width of 2 or more, as a width of 1 would be specialised).
Not `dynamic=True`: it makes every size a symbol (the KV pool's, the arena's), and the C++ wrapper turns each of them
into a tensor at every call, which costs more than the recompiles it saves.

Resident float, int8 or int4 experts of at most COMPILE_MAX_EXPERT_BYTES are computed inside the graph, by
`ArenaKernels.indexed_rows`: ids read on the device and each token's K experts' weights copied out of the arena
(int8 ones converted to the compute dtype in the same fused copy, which is exact, and scaled per output channel
after each GEMM; int4 ones copied packed, with their group scales, into torch's int4 GEMV, one unrolled pair per
routed expert), so nothing syncs with the host and nothing in Python runs per expert. That copy is why it
applies to small experts only: with large ones (the qwen3-30b-a3b geometry's 9 MiB experts) copying them out, or
reading them in place through Inductor's own reduction, decodes slower than the eager kernels.

Every other executor (experts paged through the store, prepacked, or larger) is left to run eagerly: the graph
leaves at each MoE layer through the operator `moepager::moe_layer` (models/graph_exit.py), which runs the block's
host step, observers included (a prefetcher, a trace recorder), and returns its output to the graph. Attention,
norms, routers and shared experts stay compiled; the graph is still one (no graph break per layer).

The graph ends at the final norm: the LM head runs after it, eagerly, on oneDNN-prepacked weights when it is a large
bf16 matrix (accel/packed.py), which Inductor does not trace. The other dense projections keep their plain weights in
the graph where `pack_dense` left them plain (under the ~1M elements where prepacking pays: all of a small model's);
those it prepacked (a large model's attention) leave the graph through `moepager::opaque_linear` and keep their oneDNN
kernel (unpacked inside the graph, they are slower than eager); `--dense-dtype int8-a8`'s FBGEMM projections leave it
the same way. Not bit-equal to the eager forward (fused elementwise code rounds in another order; experts sum in top-k
order): an opt-in speed choice, as `--expert-kernel packed` is. Prefill passes (more than one token a row, or a
one-token prompt's: a KV length of 1 would compile another graph), passes that replay routing, and those that record it
where the graph computes the experts itself run the eager forward.

Batched decode passes (several rows of one token: concurrent requests on the server) run compiled too, through one more
graph for every row count of two or more (the row count and the attention mask's length become symbols, so the rows' KV
lengths may differ; 6 graphs in all, RECOMPILE_LIMIT). Measured against the eager batched step by `python -m benchmarks
run batched_decode`. int4 experts inside the graph run each row's K experts unrolled, which would specialise the row
count (a compile for each), so with them batched decodes stay eager. `LLM.warm_batched_decode` compiles the batched
graphs up front (`moepager serve --compile` calls it); otherwise the first batched pass does.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from moepager.accel.packed import pack_lm_head, unfuse_dense
from moepager.errors import ConfigError
from moepager.experts.executor import ExpertExecutor, ResidentExecutor
from moepager.experts.weights import ExpertShape
from moepager.models.attention import Attention
from moepager.models.graph_exit import LeavesGraph, register, register_linear
from moepager.models.layers import CausalLM
from moepager.models.moe import MoEBlock

RECOMPILE_LIMIT = 16
"""Graphs Dynamo may compile per code object (its default is 8): a compiled decode step needs 6 (one row: static
shapes, then a symbolic KV length, then a symbolic block table width; several rows: a masked graph, a symbolic mask
length, a symbolic row count), and 6 more if the thread count changes, which its guards check. Past the limit a
`fullgraph` compile fails hard, in the middle of a request, so `compile_decode` raises it to this."""
COMPILE_MAX_EXPERT_BYTES = 1 << 20
"""Largest expert (all three projections) the compiled step copies per token and routed slot."""


def experts_in_graph(experts: ExpertExecutor, shape: ExpertShape) -> bool:
    """Whether the compiled step computes the routed experts itself (resident float, int8 or int4 experts of at most
    COMPILE_MAX_EXPERT_BYTES), or leaves its graph for the executor at each MoE layer (models/graph_exit.py)."""
    quant = shape.quant
    return (isinstance(experts, ResidentExecutor) and shape.nbytes <= COMPILE_MAX_EXPERT_BYTES
            and (quant is None or quant.bits == 8 or quant.layout == "cpu"))


def check_compilable(device: torch.device) -> None:
    """A clear error when `--compile` cannot apply to this run."""
    if device.type != "cpu":
        raise ConfigError("--compile runs on the CPU (its CUDA path has not been measured yet); leave it unset on "
                          f"{device.type}")
    from torch._inductor import cpp_builder  # here: importing Inductor is slow, and runs without it skip it

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - Inductor's own error types vary by version
        raise ConfigError(f"--compile needs a C++ compiler for TorchInductor's CPU code, and none was found ({e}); "
                          "install g++ (or set CXX), or leave --compile unset") from None


def compile_decode(model: CausalLM, experts: ExpertExecutor, shape: ExpertShape, device: torch.device) -> None:
    """Make `model` run its decode passes through a compiled graph (compiled lazily by the first such passes;
    `LLM` runs them while loading)."""
    check_compilable(device)
    unfuse_dense(model)  # moepager's GEMV for the head only: the other projections stay inside the graph
    pack_lm_head(model)
    exits = not experts_in_graph(experts, shape)
    for module in model.modules():
        if isinstance(module, Attention):  # the fused weights the eager forward makes lazily, made before tracing
            if module.qkv is None:
                module.fused_qkv()
            if module.qk_norm == "head":
                module.qk_norm_weight()
        elif isinstance(module, MoEBlock) and exits:
            module.graph_exit = register(module)
        elif isinstance(module, LeavesGraph) and module.opaque_weights:  # prepacked projections leave it too
            module.graph_exit = register_linear(module)
    model.refresh_traceable()
    dynamo = torch._dynamo.config  # process-wide: only ever raised, and only by --compile
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    model.compiled_rows = exits or shape.quant is None or shape.quant.bits != 4  # int4 in the graph: unrolled
    model.compiled_decode = torch.compile(_own_code(model.hidden_states), fullgraph=True, options={"cpp_wrapper": True})


def _own_code(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The bound method over a copy of its function's code object. Dynamo keeps compiled graphs, and counts
    recompiles against a limit of 8, per code object; every model shares `CausalLM._forward`'s, so without the
    copy a process's third or fourth compiled model would silently run eagerly (a test run found it)."""
    func = method.__func__  # type: ignore[attr-defined]
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    return types.MethodType(own, method.__self__)  # type: ignore[attr-defined]
