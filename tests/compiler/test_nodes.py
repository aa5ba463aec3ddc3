"""Predicates answer the same on an fx graph and on an exported (aten) graph."""

import operator

import pytest
import torch
from torch import nn

from ptc.compiler.graph import nodes
from ptc.compiler.capture import capture
from ptc.compiler.graph.meta import info
from ptc.models import build_model
from ptc.plan import ModelSpec

B, S = 2, 16
GPT = ModelSpec(family="gpt", layers=2, hidden=64, heads=4, vocab=100, max_seq=32)
LLAMA = ModelSpec(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100,
                  max_seq=32)
LINEARS = {
    "gpt": [f"layers.{i}.{m}" for i in (0, 1)
            for m in ("attn.qkv", "attn.o", "mlp.up", "mlp.down")] + ["head"],
    "llama": [f"layers.{i}.{m}" for i in (0, 1)
              for m in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up",
                        "mlp.down")] + ["head"],
}
NORMS = ["layers.0.attn_norm", "layers.0.mlp_norm", "layers.1.attn_norm", "layers.1.mlp_norm",
         "norm"]


@pytest.fixture(scope="module", params=[("gpt", "fx"), ("gpt", "export"), ("llama", "fx"),
                                        ("llama", "export")], ids=lambda p: "-".join(p))
def case(request):
    family, door = request.param
    spec = GPT if family == "gpt" else LLAMA
    gm = capture(build_model(spec), micro_batch=B, seq_len=S, front_door=door)
    return family, door, gm


def found(gm, predicate):
    return [r for r in map(predicate, gm.graph.nodes) if r]


def test_linears(case):
    family, door, gm = case
    assert found(gm, nodes.is_linear) == LINEARS[family]
    linear_nodes = [n for n in gm.graph.nodes if nodes.is_linear(n)]
    # the fx graph calls the module; the exported one applies aten.linear
    assert {n.op for n in linear_nodes} == {"call_module" if door == "fx" else "call_function"}
    assert all(info(n).kind == "linear" for n in linear_nodes)


def test_linear_weight_names_the_parameter_read(case):
    family, _, gm = case
    weights = found(gm, nodes.linear_weight)
    assert weights[0] == LINEARS[family][0] + ".weight"
    # GPT's head is tied: its weight is the embedding's, whichever name the graph uses
    if family == "gpt":
        assert weights[-1] in ("head.weight", "embed.weight")
    else:
        assert weights[-1] == "head.weight"


def test_embeddings(case):
    family, _, gm = case
    assert found(gm, nodes.is_embedding) == (["embed", "pos_embed"] if family == "gpt"
                                             else ["embed"])


def test_norms(case):
    assert found(case[2], nodes.is_norm) == NORMS


def test_attention(case):
    family, _, gm = case
    parts = [nodes.attention_parts(n) for n in gm.graph.nodes if nodes.is_attention(n)]
    assert len(parts) == 2
    assert all(p.fused == (family == "llama") for p in parts)
    for p in parts:
        assert info(p.q).shapes[0][:2] == (B, 4)      # query heads
        assert info(p.out).module_path.endswith(".attn")


def test_reshape_of_heads(case):
    family, _, gm = case
    reshapes = [nodes.heads_reshape(n) for n in gm.graph.nodes if nodes.is_reshape_of_heads(n)]
    kv = 4 if family == "gpt" else 2
    per_layer = [nodes.HeadsReshape(True, 4, 16), nodes.HeadsReshape(True, kv, 16),
                 nodes.HeadsReshape(True, kv, 16), nodes.HeadsReshape(False, 4, 16)]
    assert reshapes == per_layer * 2


def test_addmm_and_mm_are_linears_too():
    # A decomposed graph multiplies by the transposed weight with addmm / mm.
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2, bias=False))
    gm = torch.fx.symbolic_trace(model)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    w0, b0 = graph.get_attr("0.weight"), graph.get_attr("0.bias")
    h = graph.call_function(torch.ops.aten.addmm.default,
                            (b0, x, graph.call_function(torch.ops.aten.t.default, (w0,))))
    w1 = graph.get_attr("1.weight")
    y = graph.call_function(torch.ops.aten.mm.default,
                            (h, graph.call_function(torch.ops.aten.permute.default, (w1, [1, 0]))))
    graph.output(y)
    decomposed = torch.fx.GraphModule(gm, graph)
    assert found(decomposed, nodes.is_linear) == ["0", "1"]
    assert found(decomposed, nodes.linear_weight) == ["0.weight", "1.weight"]
    assert torch.allclose(decomposed(torch.ones(3, 8)), model(torch.ones(3, 8)))


def test_activation_matmul_is_not_a_linear():
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output(graph.call_function(torch.matmul, (a, b)))
    node = list(graph.nodes)[2]
    assert nodes.is_linear(node) is None
    assert nodes.classify(node) == "matmul"


def test_op_names():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    made = [graph.call_function(torch.ops.aten._softmax.default, (x, -1, False)),
            graph.call_method("view", (x, -1)),
            graph.call_function(torch.nn.functional.scaled_dot_product_attention, (x, x, x))]
    assert [nodes.op_name(n) for n in made] == ["softmax", "view", "scaled_dot_product_attention"]
    assert [nodes.classify(n) for n in made] == ["softmax", "view", "attention"]


class ScaledLinear(nn.Linear):
    """A Linear subclass: fx traces through it, export names it by qualified class."""

    def forward(self, x):
        return super().forward(x) * 2.0


class WithSubclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.proj = ScaledLinear(16, 16)
        self.head = nn.Linear(16, 100)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.proj(self.embed(tokens)))


@pytest.mark.parametrize("door", ["fx", "export"])
def test_linear_subclass_and_tied_head(door):
    gm = capture(WithSubclass(), micro_batch=B, seq_len=S, front_door=door)
    assert found(gm, nodes.is_linear) == ["proj", "head"]


def test_min_and_max_of_two_tensors_and_comparisons_are_elementwise():
    # xIELU's torch.min(x, eps) and x > 0: elementwise, so a tp split passes through them;
    # x.max(-1) reduces over a dimension.
    graph = torch.fx.Graph()
    x, eps = graph.placeholder("x"), graph.placeholder("eps")
    for placeholder in (x, eps):
        placeholder.meta["val"] = torch.empty(2, 3, device="meta")
    made = [graph.call_function(torch.min, (x, eps)), graph.call_method("max", (x, -1)),
            graph.call_function(operator.gt, (x, 0))]
    graph.output(tuple(made))
    assert [nodes.classify(n) for n in made] == ["pointwise", "reduction", "pointwise"]


class LearnedActivation(nn.Module):
    """x · softplus(alpha): a parameter seen through an activation, as xIELU's."""

    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * nn.functional.softplus(self.alpha)


def test_a_parameter_seen_through_an_activation_is_behind_it():
    # Where softplus(alpha) is read decides how alpha's gradient is summed over tp: a read
    # inside a split region makes it partial (left out, each rank kept its own part).
    gm = torch.fx.symbolic_trace(LearnedActivation())
    behind = {n.name: names for n, names in nodes.params_behind(gm).items()}
    assert behind == {"alpha": ("alpha",), "softplus": ("alpha",)}


@pytest.mark.parametrize("flipped", [False, True])
def test_scores_masked_by_where_are_followed_through_its_kept_values(flipped):
    """GPT-Neo masks its scores as where(causal, scores, min): the scores are the operand
    shaped as the output, in either place, not the condition."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def attend(q, k, v, causal):
        scores = q @ k.transpose(-2, -1)
        low = torch.tensor(torch.finfo(scores.dtype).min)
        masked = torch.where(~causal, low, scores) if flipped else \
            torch.where(causal, scores, low)
        return torch.softmax(masked, dim=-1) @ v

    q = torch.randn(1, 2, 8, 4)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    gm = make_fx(attend)(q, q, q, causal)
    (parts,) = [nodes.attention_parts(n) for n in gm.graph.nodes if nodes.is_attention(n)]
    # The scores' batched matmul: queries [.., 8 positions, 4], transposed keys [.., 4, 8].
    assert nodes.node_shape(parts.q)[-2:] == (8, 4)
    assert nodes.node_shape(parts.k)[-2:] == (4, 8)
    assert nodes.op_name(parts.scores) == "where"
