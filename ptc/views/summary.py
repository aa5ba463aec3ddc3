"""What a captured model is, in numbers: parameters, FLOPs, layers, and the
nodes the passes will work on. `ptc compile PLAN` prints this.

Terms: *forward FLOPs per step* are those of one captured micro-batch
(micro_batch · seq_len tokens); *model FLOPs* are forward + backward, taken
as 3x forward (backward computes two matmuls per forward matmul), the
convention of MFU figures (PaLM, Megatron). FLOP counting follows
ptc.compiler.graph.flops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ptc.compiler.graph import nodes
from ptc.compiler.graph.meta import get_info, graph_info
from ptc.views.tables import FitTable

MATMUL_KINDS = ("linear", "matmul", "attention")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerSummary:
    """One repeated block, as representative of all of them."""

    index: int
    """Which layer this is (the first)."""
    params: int
    """Parameter elements of the block."""
    flops: int
    """Forward FLOPs of the block for one micro-batch."""
    linear_flops: int
    """Of which in linears (2·tokens·weights)."""
    attention_flops: int
    """Of which in attention score/value products (SDPA or written-out matmuls)."""
    linears: tuple[str, ...]
    """Linears of the block, paths relative to it ("attn.q", "mlp.up")."""
    nodes: int
    """Graph nodes of the block."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSummary:
    """The model as captured: sizes, FLOPs, and the nodes passes act on."""

    model_class: str
    """Class name of the captured model."""
    front_door: str
    """"fx" or "export"."""
    micro_batch: int
    """Captured micro-batch b."""
    seq_len: int
    """Captured sequence length s."""
    dtype: torch.dtype
    """Compute dtype of the capture."""
    params: int
    """Parameter elements, tied parameters counted once."""
    param_bytes: int
    """Bytes of those parameters at the compute dtype."""
    flops_per_step: int
    """Forward FLOPs of one micro-batch (b·s tokens), loss included."""
    matmul_flops_per_step: int
    """Of which in linears and attention products."""
    num_layers: int
    """Repeated blocks found."""
    blocks_path: str | None
    """Module path of the blocks ("layers")."""
    layer: LayerSummary | None
    """The first block, standing for all (None when no blocks were found)."""
    layers_identical: bool
    """True when every block has the same parameters and FLOPs as the first."""
    linears: tuple[str, ...]
    """Module paths of every linear (the tensor-parallel pass shards these)."""
    attentions: tuple[str, ...]
    """Module paths of every attention."""
    causal_masks: int = 0
    """Attentions handed exactly the causal mask, run as the causal kernel instead."""
    norms: tuple[str, ...]
    """Module paths of every normalisation (sequence parallel acts around these)."""
    embeddings: tuple[str, ...]
    """Module paths of every embedding lookup."""
    nodes: int
    """Nodes in the graph."""

    @property
    def tokens_per_step(self) -> int:
        """b · s."""
        return self.micro_batch * self.seq_len

    @property
    def flops_per_token(self) -> float:
        """Forward FLOPs per token."""
        return self.flops_per_step / self.tokens_per_step

    @property
    def model_flops_per_step(self) -> int:
        """Forward + backward FLOPs of one micro-batch: 3x forward."""
        return 3 * self.flops_per_step

    @property
    def model_flops_per_token(self) -> float:
        """Forward + backward FLOPs per token: 3x forward."""
        return 3 * self.flops_per_token


def summarize(gm: fx.GraphModule) -> ModelSummary:
    """Summarise a graph made by `ptc.compiler.capture`."""
    cap = graph_info(gm)
    params = {id(p): p for p in (*gm.parameters(),)}
    total_params = sum(p.numel() for p in params.values())
    found: dict[str, list[str]] = {"linear": [], "attention": [], "norm": [], "embedding": []}
    per_layer: dict[int, dict] = {}
    flops = matmul_flops = 0
    for node in gm.graph.nodes:
        info = get_info(node)
        if info is None:
            continue
        flops += info.flops
        if info.kind in MATMUL_KINDS:
            matmul_flops += info.flops
        _collect(node, found)
        if info.layer is not None:
            stats = per_layer.setdefault(info.layer, dict(params=0, flops=0, linear=0, attn=0,
                                                          nodes=0, linears=[]))
            stats["params"] += info.params
            stats["flops"] += info.flops
            stats["nodes"] += 1
            if info.kind == "linear":
                stats["linear"] += info.flops
            elif info.kind in ("attention", "matmul"):
                stats["attn"] += info.flops
            path = nodes.is_linear(node)
            if path:
                stats["linears"].append(path)
    layer = None
    identical = True
    if per_layer:
        first = min(per_layer)
        stats = per_layer[first]
        prefix = f"{cap.blocks_path}.{first}."
        layer = LayerSummary(
            index=first, params=stats["params"], flops=stats["flops"],
            linear_flops=stats["linear"], attention_flops=stats["attn"],
            linears=tuple(p[len(prefix):] if p.startswith(prefix) else p
                          for p in stats["linears"]),
            nodes=stats["nodes"])
        identical = all((s["params"], s["flops"]) == (stats["params"], stats["flops"])
                        for s in per_layer.values())
    return ModelSummary(
        model_class=cap.model_class, front_door=cap.front_door, micro_batch=cap.micro_batch,
        seq_len=cap.seq_len, dtype=cap.dtype, params=total_params,
        param_bytes=total_params * cap.dtype.itemsize, flops_per_step=flops,
        matmul_flops_per_step=matmul_flops, num_layers=cap.num_layers,
        blocks_path=cap.blocks_path, layer=layer, layers_identical=identical,
        linears=tuple(found["linear"]), attentions=tuple(found["attention"]),
        causal_masks=cap.causal_masks,
        norms=tuple(found["norm"]), embeddings=tuple(found["embedding"]),
        nodes=len(gm.graph.nodes))


def _collect(node: fx.Node, found: dict[str, list[str]]) -> None:
    path = nodes.is_linear(node)
    if path is not None:
        found["linear"].append(path)
        return
    path = nodes.is_embedding(node)
    if path is not None:
        found["embedding"].append(path)
        return
    if nodes.is_attention(node):
        found["attention"].append(get_info(node).module_path)
        return
    path = nodes.is_norm(node)
    if path is not None:
        found["norm"].append(path)


# ----------------------------------------------------------------- render


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6),
                        ("KFLOP", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def _bytes(n: float) -> str:
    from ptc.units import format_bytes  # noqa: PLC0415 - keeps the import list short

    return format_bytes(n)


def _paths(paths: tuple[str, ...], blocks: str | None, limit: int = 6) -> str:
    """Paths with the layer index folded to `*`, each distinct pattern once."""
    seen: list[str] = []
    for path in paths:
        if blocks and path.startswith(blocks + "."):
            head, _, rest = path[len(blocks) + 1:].partition(".")
            if head.isdigit():
                path = f"{blocks}.*.{rest}" if rest else f"{blocks}.*"
        if path not in seen:
            seen.append(path)
    text = ", ".join(seen[:limit])
    return text + (f", ... (+{len(seen) - limit})" if len(seen) > limit else "")


def summary_rows(summary: ModelSummary) -> list[tuple[str, str]]:
    """(label, value) rows of a summary, in display order."""
    s = summary
    rows = [
        ("model", f"{s.model_class} (captured by {s.front_door}, "
                  f"b={s.micro_batch}, s={s.seq_len}, {str(s.dtype).removeprefix('torch.')})"),
        ("parameters", f"{_count(s.params)} ({s.params:,}), {_bytes(s.param_bytes)}"),
        ("layers", f"{s.num_layers} x {s.blocks_path}" if s.blocks_path else "none found"),
        ("forward FLOPs / token", f"{_flops(s.flops_per_token)} "
                                  f"({s.matmul_flops_per_step / max(s.flops_per_step, 1):.1%} "
                                  "in matmuls)"),
        ("forward FLOPs / step", _flops(s.flops_per_step)),
        ("model FLOPs (fwd+bwd = 3x) / token", _flops(s.model_flops_per_token)),
        ("model FLOPs (fwd+bwd = 3x) / step", _flops(s.model_flops_per_step)),
    ]
    if s.layer is not None:
        lay = s.layer
        same = "all layers alike" if s.layers_identical else "layers differ"
        rows += [
            (f"layer {lay.index}: parameters", f"{_count(lay.params)} ({same})"),
            (f"layer {lay.index}: forward FLOPs",
             f"{_flops(lay.flops)} = linear {_flops(lay.linear_flops)} + attention "
             f"{_flops(lay.attention_flops)} + other "
             f"{_flops(lay.flops - lay.linear_flops - lay.attention_flops)}"),
            (f"layer {lay.index}: linears", ", ".join(lay.linears)),
        ]
    rows += [
        (f"linears ({len(s.linears)})", _paths(s.linears, s.blocks_path)),
        (f"attentions ({len(s.attentions)})", _paths(s.attentions, s.blocks_path)
         + (f"; {s.causal_masks} handed exactly the causal mask run the causal kernel "
            "instead" if s.causal_masks else "")),
        (f"norms ({len(s.norms)})", _paths(s.norms, s.blocks_path)),
        (f"embeddings ({len(s.embeddings)})", _paths(s.embeddings, s.blocks_path)),
        ("graph nodes", str(s.nodes)),
    ]
    return rows


def render_summary(summary: ModelSummary) -> FitTable:
    """The summary as a boxed key/value table (print it with a rich Console); a FitTable,
    so that its values wrap whole at any width."""
    table = FitTable(title=f"ptc: {summary.model_class}", show_header=False)
    table.add_column("what")
    table.add_column("value")
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    return table


def format_summary(summary: ModelSummary) -> str:
    """The summary as plain text, one `label: value` line per row."""
    rows = summary_rows(summary)
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
