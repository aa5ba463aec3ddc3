"""Per-shape profile of a model: closed-form per-layer quantities, read off its graph once.

The cost model and the plan search evaluate thousands of layouts; none of
them captures a graph. Instead a model *shape* (family, widths, vocab, dtype)
is captured once, with a single transformer layer, at six (b, s) points on
the meta device. Per graph region every quantity — saved activation bytes
(`activations`), forward FLOPs (capture's `NodeInfo.flops`) — is a
polynomial in b and s of degree <= 1 in b and <= 2 in s, so six points fix
it exactly; a seventh checks it. All layers of a block stack are alike, so
layer 0's polynomials times the layer count give the stack.

Regions: `pre` (embedding, before the first layer), `layer` (layer 0),
`post` (final norm, head, loss).

Classes of saved bytes within a region, which decide how parallelism divides
them:
- `tp`: made between a column-parallel linear (qkv, q, k, v, up, gate, the
  vocab-parallel head) and the row-parallel linear that closes the block
  (o, down): each tensor-parallel rank holds 1/t of it;
- `seq`: everything else that carries the batch (norm inputs, residual
  stream, dropout masks after the row-parallel linear): replicated over tp,
  split 1/t along the sequence with sequence parallelism;
- `const`: terms with no batch factor (a causal mask built from s): every
  rank holds them whole.
Each class is also split by whether selective recompute (of the attention
core as `recompute.attention_cores` finds it: scores to probabilities @ values,
or the fused kernel) drops it, and the
layer's *output* (what the next layer keeps as its input under full
recompute) is recorded separately, with the parts of the tensors crossing
the layer's two boundaries that no node saves (`ModelProfile.output_unsaved`,
`input_unsaved`): only a checkpoint or the pipeline runtime keeps those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx

from ptc.compiler.graph.gemm_tiles import GemmShape
from ptc.plan import ModelSpec

b, s = sympy.symbols("b s", positive=True, integer=True)
"""Micro-batch and sequence length symbols of every profile polynomial."""

MONOMIALS = (sympy.Integer(1), s, s**2, b, b * s, b * s**2)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}
"""Train dtype -> the dtype its model is captured in (fp8 keeps bf16 but for its GEMMs)."""


@dataclass(frozen=True, slots=True)
class SavedClasses:
    """Saved-activation bytes of one region, per micro-batch, unsharded, by class."""

    tp: sympy.Expr
    """Between column- and row-parallel linears: 1/t per tp rank."""
    seq: sympy.Expr
    """Replicated over tp; 1/t with sequence parallelism."""
    const: sympy.Expr
    """No batch factor: whole on every rank."""
    core_tp: sympy.Expr
    """Part of `tp` that selective recompute drops."""
    core_seq: sympy.Expr
    """Part of `seq` that selective recompute drops."""
    core_const: sympy.Expr
    """Part of `const` that selective recompute drops."""
    kv: sympy.Expr = sympy.Integer(0)
    """Part of `tp` made from the key/value projections alone, before k and v meet the
    queries: whole on every rank when tp exceeds the key/value heads (`kv_divisor`)."""
    core_kv: sympy.Expr = sympy.Integer(0)
    """Part of `kv` that selective recompute drops."""
    whole: sympy.Expr = sympy.Integer(0)
    """Part of `seq` that every tp rank keeps whole even with sequence parallelism: token
    ids and targets (the vocabulary-parallel embedding and loss read the whole sequence),
    a row-parallel linear's output that a saving region keeps (made before its
    reduce-scatter), and what a module kept whole by a rule saves where it mixes positions
    (`whole_under_sp`)."""
    core_whole: sympy.Expr = sympy.Integer(0)
    """Part of `whole` that selective recompute drops (a whole attention's scores)."""
    split_const: sympy.Expr = sympy.Integer(0)
    """Part of `const` each tp rank keeps 1/t of: the column scales of the float8 copies
    row-parallel linears keep under `train.fp8_recipe = rowwise` (one fp32 per input
    feature of the rank's shard, `profile.fp8`)."""

    @property
    def total(self) -> sympy.Expr:
        """All classes together (no parallelism, no recompute)."""
        return self.tp + self.seq + self.const


@dataclass(frozen=True, slots=True)
class ParamGroups:
    """Parameter elements of one region, by how tensor parallelism splits them."""

    split: int
    """Elements divided by t (column/row-parallel weights, column biases, vocab tables)."""
    replicated: int
    """Elements every tp rank holds whole (norms, row-parallel biases, positions)."""
    tensors: int
    """Parameter tensors (an optimizer keeps a step counter per tensor)."""
    kv: int = 0
    """Part of `split`: the key/value projections, whole on every rank when tp exceeds the
    key/value heads (`ModelProfile.kv_divisor`)."""
    experts: int = 0
    """Part of `split`: the routed experts' stacks, 1/ep of them per rank under expert
    parallelism (`parallel.ep`)."""
    experts_whole: int = 0
    """Part of `replicated`: expert stacks a shard rule keeps whole over tp."""

    @property
    def total(self) -> int:
        """All elements of the region."""
        return self.split + self.replicated


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Everything the memory and cost models need to know about one model shape."""

    layers: int
    """Transformer layers L."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads a."""
    kv_heads: int
    """Key/value heads of the attention (= heads without grouped-query attention)."""
    vocab: int
    """Vocabulary V."""
    dtype_bytes: int
    """Bytes per element of the compute dtype."""
    saved: dict[str, SavedClasses]
    """Saved activation bytes per region ("pre", "layer", "post")."""
    layer_output: SavedClasses
    """Bytes of a layer's output, whether or not a node after it saves that storage, and of
    any other storage of the layer that a node after it saves: all a fully recomputed layer
    keeps (its output is the next layer's checkpointed input, or a stage's output)."""
    output_unsaved: SavedClasses
    """Part of `layer_output` that no node after the layer saves (bf16 RMSNorm saves an fp32
    copy of its input, not the input): kept only by the next layer's checkpoint or by the
    pipeline runtime, so `saved["layer"]` leaves it out, and after the model's last layer
    nothing keeps it (`memory._chunk_ends`)."""
    input_unsaved: SavedClasses
    """Bytes of what the first layer reads from before it (its input) that no node saves:
    `saved["pre"]` leaves it out, a fully recomputed first layer's checkpoint keeps it."""
    flops: dict[str, sympy.Expr]
    """Forward FLOPs per region, per micro-batch."""
    core_flops: sympy.Expr
    """Forward FLOPs of one layer's attention core (what selective recompute reruns)."""
    kv_flops: sympy.Expr
    """Forward FLOPs of one layer's key/value path (its projections, RoPE on k): divided
    by `kv_divisor` rather than tp."""
    fp8_flops: sympy.Expr
    """Forward FLOPs of one layer's float8 GEMMs (`nodes.is_fp8_linear`, and its routed
    experts' grouped products, `nodes.is_fp8_grouped`) when profiled for train dtype "fp8",
    else 0."""
    work: dict[str, sympy.Expr]
    """What each region asks of the device per micro-batch (`ptc.compiler.graph.work`), by
    "{region}.{phase}.{quantity}.{class}": region "pre", "layer", "post", "core" (the
    layer's attention core, part of "layer") or `rerun_region(policy)` (what one layer's
    recompute reruns under a policy of `policy_saved`, "fwd" only); phase "fwd" or "bwd";
    quantity "gemm" (FLOPs), "attn" (fused attention FLOPs), "mem" (bytes moved, each op its
    own kernel), "fmem" (bytes moved by fused kernels), "ops" (ops dispatched) and "kern"
    (kernels launched when fused; these two class "all" only); class "all", "tp" (the part
    tensor parallelism splits: between a column-parallel linear and the row-parallel one
    that closes the block, that one included), "kv" (the part of "tp" on the key/value
    path, split by `kv_divisor`) or "whole" (the part outside "tp" that sequence
    parallelism runs on the whole sequence: a module kept whole where it mixes positions,
    `whole_under_sp`). Fitted for micro-batches of
    2 and more: at one sample torch's matmul views some operands it copies at more."""
    work_b1: dict[str, sympy.Expr]
    """`work` at a micro-batch of one sample, polynomials in s alone."""
    params: dict[str, ParamGroups]
    """Parameters per region; "post" excludes a head tied to the embedding."""
    tied: bool
    """Head and embedding share one weight."""
    tied_elements: int
    """Elements of the tied weight (0 when untied)."""
    boundary_elements: sympy.Expr
    """Elements of the tensor passed between layers (b·s·h): pipeline and TP traffic."""
    causal_kernel: bool = False
    """The layer's fused attention is a causal flash kernel, its `work` counted at the half
    of the score tiles it computes (`ptc.compiler.graph.work.CAUSAL_SHARE`); context
    parallelism's own kernel is priced from every tile of it (`ptc.ops.context.key_tile_share`)."""
    gemms: dict[str, tuple[GemmShape, ...]] = field(default_factory=dict)
    """The GEMMs of each region's phase ("{region}.{phase}", regions and phases as `work`)
    with their shapes (`ptc.compiler.graph.gemm_tiles`), for micro-batches of 2 and more; a
    region's phase whose shapes do not fit is absent (priced by its FLOPs alone)."""
    gemms_b1: dict[str, tuple[GemmShape, ...]] = field(default_factory=dict)
    """`gemms` at a micro-batch of one sample."""
    policy_saved: dict[str, SavedClasses] = field(default_factory=dict)
    """Per recompute policy of `recompute.EXTRA_POLICIES` the model has: the saved bytes of
    one layer under it (what its nodes outside the policy's regions save, the regions'
    inputs, a saving region's matmul outputs), charged like `saved["layer"]`."""
    policy_flops: dict[str, sympy.Expr] = field(default_factory=dict)
    """Per policy of `policy_saved`: forward FLOPs of what it recomputes in one layer."""
    policy_gathers: dict[str, int] = field(default_factory=dict)
    """Per policy of `policy_saved`: the inputs of column-parallel linears one layer's regions
    recompute (a norm's output under `norm`) — under sequence parallelism each is an
    all-gather that backward's recompute reruns."""
    routed_rows: int = 0
    """Rows one layer's routed experts compute per token (the router's top-k): what expert
    parallelism's all-to-alls move, b·s·routed_rows rows of `hidden` each; 0 without
    routed experts."""
    routed_experts: int = 0
    """Routed experts of one layer (what `parallel.ep` must divide); 0 without."""
    tp_entries: float = 2
    """Tensor-parallel regions one layer enters (distinct inputs of its column-parallel
    linears): an all-reduce of the input gradient each in backward (with sequence
    parallelism: an all-gather forward, a reduce-scatter backward). Counted in layer
    boundaries moved: routed experts' entry counts top-k, a low-rank input its share."""
    tp_exits: float = 2
    """Row-parallel linears of one layer: an all-reduce of the output each in forward (with
    sequence parallelism: a reduce-scatter forward, an all-gather backward); counted in
    layer boundaries moved, as `tp_entries`."""
    sp_gathered: sympy.Expr = sympy.Integer(0)
    """Bytes, whole, that sequence parallelism all-gathers in one layer's forward for modules
    a rule keeps whole (`whole_under_sp`: the inputs of the ops mixing positions)."""
    sp_scattered: sympy.Expr = sympy.Integer(0)
    """Bytes, whole, of those modules' outputs scattered back to the split sequence: their
    gradients are all-gathered in backward."""
    sp_saved: dict[str, SavedClasses] = field(default_factory=dict)
    """Under sequence parallelism, where it runs something whole (`whole_under_sp`): the
    saved bytes of every region of `saved`, of "out", "out_unsaved", "in_unsaved" and of
    every policy of `policy_saved`, measured on the graph as sequence parallelism lowers it
    (`with_gathered_copies`): a split tensor that a whole op reads is gathered into a new
    whole tensor, kept besides the split one wherever both are kept (a saving region's
    linear output, split, and the attention's gathered input). Empty when sequence
    parallelism runs nothing whole: `saved` and the others hold then."""
    holds_input: frozenset[str] = frozenset({"full"})
    """Policies whose checkpoint keeps the layer's input (a region reads it): like "full",
    they keep what crosses into the layer whether or not a node saves it."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """Policies the model's layers cannot take -> why (the CompileError's message)."""
    layer_paths: tuple[str, ...] = ()
    """The module paths of layer 0 that `shard` rules place (`tp_structure.rule_paths`),
    its index as "{}" ("layers.{}.mlp.up"): the profile prices every layer as layer 0, which
    holds only while the plan's rules place every layer alike (`_check_rules_alike`)."""
    shape: ModelSpec | None = None
    """For a custom model: its plan's model section with the shape its graph shows
    (`graph_shape`); None for a built-in family, whose plan names its shape."""
    fn: Mapping[str, Callable] = field(default_factory=dict, compare=False, repr=False)
    """The polynomials above as fast functions of (b, s), by dotted name ("layer.tp",
    "out.seq", "flops.post", "core_flops", "boundary"); they accept sympy symbols too."""
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    """Cache of derived per-layer values, shared by copies that differ only in `layers`."""

    def kv_divisor(self, tp: int) -> int:
        """How many ways tensor parallelism of degree `tp` splits the key/value path: tp
        when tp divides the key/value heads, else 1 (fewer heads than ranks: replicated)."""
        return tp if self.kv_heads % tp == 0 else 1


@dataclass(frozen=True, slots=True)
class Unprofiled:
    """What `model_profile` keeps for a model it cannot profile: the reason, said again."""

    reason: str
SAVED_REGIONS = ("pre", "layer", "post", "out", "out_unsaved", "in_unsaved")
"""Keys of `measure_saved`'s saved bytes: the graph regions and `ModelProfile`'s boundary terms."""


SAVED_CLASS_TERMS = ("tp", "seq", "core_tp", "core_seq", "kv", "core_kv", "whole", "core_whole",
                     "split_const")
"""The classes `measure_saved` reports saved bytes in (`SavedClasses`, before `saved_classes`)."""


WORK_REGIONS = ("pre", "layer", "post", "core")
WORK_QUANTITIES = ("gemm", "attn", "mem", "fmem", "ops", "kern")
COUNTS = ("ops", "kern")
"""Quantities that count calls, taken whole on every rank (class "all" only)."""
WORK_CLASSES = ("all", "tp", "kv", "whole")


FP8_SCALE_BYTES = 8
"""What a tensorwise float8 linear saves beside its input's copy: the input's and the
weight's scales, one fp32 each (`ptc.ops.fp8_linear`)."""
ROWWISE_SCALE_BYTES = 4
"""What a rowwise float8 linear saves beside its input's column copy per input feature: the
column's fp32 scale."""
MX_SCALE_ELEMENTS = 32
"""Elements of an mxfp8 copy per E8M0 scale byte kept beside it (one block)."""
