"""The metadata records ptc writes on graphs: `NodeInfo` on every node and `GraphRecord`
on a GraphModule, both under one key (`KEY`) of `meta`; `ptc.compiler.graph.meta` reads
and updates them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ptc.compiler.records.overlap import OverlapPlan
    from ptc.compiler.records.stages import PipelineInfo, StageInfo
    from ptc.compiler.records.tp_layout import TensorParallelLayout
    from ptc.compiler.records.ep_layout import ExpertParallelLayout


KEY = "ptc"
"""The one node.meta / gm.meta key ptc writes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeInfo:
    """What capture knows about one node of the captured graph."""

    module_path: str
    """Innermost module whose forward produced the node; "" at the model's top level."""
    module_type: str
    """Class name of that module ("Linear", "LlamaAttention"); "" at top level."""
    layer: int | None
    """Index of the repeated block (`layers.{i}`) the node belongs to; None outside."""
    kind: str
    """What the node does, for passes and reports: one of `KINDS`."""
    shapes: tuple[tuple[int, ...], ...]
    """Shapes of the tensor outputs (one entry per output tensor; () for none)."""
    dtypes: tuple[torch.dtype, ...]
    """Dtypes of the tensor outputs, parallel to `shapes`."""
    flops: int
    """Forward FLOPs (see ptc.compiler.graph.flops for the counting convention)."""
    params: int
    """Parameter elements the node reads directly (call_module leaf or get_attr)."""
    param_bytes: int
    """Bytes of those parameters at the captured compute dtype."""
    source: str | None = None
    """User source line that created the node, "file.py:123", when known."""

    @property
    def out_bytes(self) -> int:
        """Bytes of the node's tensor outputs."""
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = 1
            for d in shape:
                n *= d
            total += n * dtype.itemsize
        return total


KINDS = ("input", "param", "buffer", "output", "linear", "embedding", "attention", "matmul", "norm",
         "activation", "pointwise", "reduction", "softmax", "dropout", "loss", "view",
         "creation", "other")
"""Node kinds. `view` covers every data-movement op (view, transpose, cat, getitem)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CaptureInfo:
    """What capture recorded about the whole graph (in its GraphRecord)."""

    front_door: str
    """"fx" (torch.fx.symbolic_trace) or "export" (torch.export, aten graph)."""
    model_class: str
    """Class name of the captured model."""
    micro_batch: int
    """b the graph was captured at."""
    seq_len: int
    """s the graph was captured at."""
    dtype: torch.dtype
    """Compute dtype of parameters and activations in the annotations."""
    with_loss: bool
    """True: the graph takes (tokens, targets) and returns the mean loss."""
    model_loss: bool
    """True when the loss is the model's own (forward took targets/labels)."""
    blocks_path: str | None
    """Module path of the repeated blocks ("layers", "transformer.h"), if found."""
    num_layers: int
    """Number of repeated blocks."""
    vocab: int | None
    """Last dimension of the logits."""
    causal_masks: int = 0
    """Attentions handed exactly the causal mask that capture gave the causal kernel instead
    (`ptc.compiler.capture.causal_kernel`)."""
    frozen: tuple[str, ...] = ()
    """Parameters the model does not train (requires_grad = False), by every name the model
    holds them under: the optimizer keeps their values (`ShardedOptimizer`)."""
    constants: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Tensors the model's forward creates from Python values (`torch.tensor([-2])`), which
    the export door lifts into the graph as buffers, by buffer name: their real values
    (every other buffer comes from the model)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphRecord:
    """Everything ptc records about one GraphModule, under gm.meta["ptc"]."""

    capture: CaptureInfo
    """What capture found (stage graphs carry their whole graph's)."""
    tensor_parallel: TensorParallelLayout | None = None
    """How the tensor_parallel pass split the parameters (None: not split over tp)."""
    expert_parallel: ExpertParallelLayout | None = None
    """How the expert_parallel pass spread the routed experts (None: ep = 1)."""
    pipeline: PipelineInfo | None = None
    """Set on the pipeline graph the split returns: its stages and tied weights."""
    stage: StageInfo | None = None
    """Set on a stage graph: its place in the pipeline and what crosses its edges."""
    overlap: OverlapPlan | None = None
    """The comm_overlap pass's buckets and overlap decisions (collected into the Decisions
    after the per-stage passes)."""
