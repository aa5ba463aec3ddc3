"""The context_parallel pass (split_context_pass) on small captured graphs.

Which attentions become context_attention, where the batch and whole-sequence
tensors enter the split sequence (context_chunks), the local shapes, and the
one-line refusals of what cp cannot split. Numerical equivalence on several
processes is in tests/distributed/test_cp_equivalence.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers.integrations.moe  # noqa: F401 - registers grouped_mm_fallback
from torch import fx, nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests" / "distributed"):  # plain `pytest` puts neither on the path
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from hf_helpers import HFCase, hf_module, hf_plan  # noqa: E402

from ptc.compiler.graph.meta import get_info  # noqa: E402
from ptc.compiler.graph.nodes import op_name  # noqa: E402
from ptc.errors import CompileError, PlanError  # noqa: E402
from ptc.lower.driver import apply_pass, capture_plan  # noqa: E402
from ptc.ops.context import context_attention, context_chunks, context_reduce  # noqa: E402
from ptc.ops.positions import chunk_positions, gathered_order  # noqa: E402
from ptc.passes import split_context_pass  # noqa: E402
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec  # noqa: E402

pytestmark = pytest.mark.timeout(120)

GPT = ModelSpec(family="gpt", layers=2, hidden=32, heads=4, vocab=64, max_seq=16)
LLAMA = ModelSpec(family="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64,
                  max_seq=16)


def plan(model: ModelSpec = GPT, *, cp: int = 2, seq: int = 16) -> Plan:
    return Plan(model=model, hardware=HardwareSpec.preset("cpu", gpus_per_node=cp),
                parallel=ParallelSpec(cp=cp),
                train=TrainSpec(seq_len=seq, global_batch=2, micro_batch=2, dtype="fp32"))


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def test_positions_are_balanced_chunks_and_the_gather_order_inverts_them() -> None:
    assert chunk_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    held = torch.cat([chunk_positions(12, r, 3) for r in range(3)])
    assert held[gathered_order(12, 3)].tolist() == list(range(12))


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_attention_gathers_keys_and_the_sequence_is_split(model: ModelSpec) -> None:
    p = plan(model)
    gm = apply_pass(split_context_pass, capture_plan(p), p)
    assert len(calls(gm, context_attention)) == model.layers
    entered = {n.args[0].name for n in calls(gm, context_chunks)}
    assert {"tokens", "targets"} <= entered
    for node in calls(gm, context_attention):  # the rank's 8 of 16 queries, all heads
        assert get_info(node).shapes[0][-2] == 8
    assert not any(n.op == "call_method" and n.target == "size" for n in gm.graph.nodes)


def test_sequence_not_divisible_by_two_cp_is_refused_at_the_field() -> None:
    with pytest.raises(PlanError, match=r"seq_len\(18\) is not divisible by 2 \* cp\(2\)"):
        plan(seq=18)


class _TinyAttentionLM(nn.Module):
    """Embedding, one 4-head attention's fused q/k/v projection, head: what the cases below
    share; each writes its own forward around `heads`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.qkv = nn.Linear(32, 96)
        self.head = nn.Linear(32, 64)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [b, 4, s, 8] of x [b, s, 32]."""
        b, s, _ = x.shape
        return self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)


class _MaskedAttention(_TinyAttentionLM):
    """Attention through a boolean mask the model builds from constants: `window` = None
    gives the causal mask (cp splits it), a window gives a sliding-window one (refused)."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        q, k, v = self.heads(self.embed(tokens))
        mask = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
        if self.window is not None:
            mask = mask & ~torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril(
                -self.window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(y.transpose(1, 2).reshape(b, s, 32))


def test_a_mask_built_from_constants_is_split_when_it_is_the_causal_one() -> None:
    p = plan()
    gm = apply_pass(split_context_pass, capture_plan(p, _MaskedAttention(None)), p)
    assert len(calls(gm, context_attention)) == 1
    assert not any(n.op == "call_method" and n.target == "tril" for n in gm.graph.nodes)
    with pytest.raises(CompileError, match="not causal attention"):
        apply_pass(split_context_pass, capture_plan(p, _MaskedAttention(4)), p)


class _CumulativeMix(_TinyAttentionLM):
    """Causal attention plus a running mean over the sequence (cumsum along it): correct on
    one process, wrong on a rank's chunks, so cp must refuse it."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        x = self.embed(tokens)
        x = x + x.cumsum(dim=1)
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(y.transpose(1, 2).reshape(b, s, 32))


def test_a_cumulative_sum_along_the_sequence_is_refused() -> None:
    p = plan()
    with pytest.raises(CompileError, match="mixes positions along the sequence"):
        apply_pass(split_context_pass, capture_plan(p, _CumulativeMix()), p)


# --- flattened token rows: per-token work passes, mixing of positions does not

EXPERTS = 4


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' grouped product (x [N, in] by w [experts, in, out]), which has a meta
    kernel in fp32."""
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs)


_MIXES = {"none": lambda t: t, "cumsum": lambda t: t.cumsum(0),
          "softmax": lambda t: t.softmax(0), "mean": lambda t: t - t.mean(0),
          "max": lambda t: t - t.amax(0)}
"""Ops on the flattened token rows [b·s, 32] before the router: along the tokens."""


class _RoutedLM(_TinyAttentionLM):
    """Causal attention, then a mixture of experts on the flattened token rows [b·s, 32]:
    a softmax top-2 router over 4 experts (topk along its default, the experts), the rows
    sorted by expert, counted per expert (histc) into the offsets of grouped products, and
    brought `back` to the tokens: by the sort's inverse order ("inverse", transformers'
    way), added back per token ("index_add"), or not at all ("none": the grouped rows
    summed as if they were the tokens' own). `mix`: an op along the tokens first."""

    def __init__(self, back: str = "inverse", mix: str = "none") -> None:
        super().__init__()
        self.back, self.mix = back, mix
        self.router = nn.Linear(32, EXPERTS, bias=False)
        self.w_up = nn.Parameter(torch.randn(EXPERTS, 32, 64) * 0.1)
        self.w_down = nn.Parameter(torch.randn(EXPERTS, 64, 32) * 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        q, k, v = self.heads(self.embed(tokens))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        flat = _MIXES[self.mix](y.transpose(1, 2).reshape(b * s, 32))
        weights, ids = self.router(flat).softmax(-1).topk(2)
        sorted_ids, order = ids.reshape(-1).sort()
        offs = torch.cumsum(torch.histc(sorted_ids.float(), bins=EXPERTS, min=0,
                                        max=EXPERTS - 1), 0, dtype=torch.int32)
        rows = F.silu(_grouped_mm(flat[order // 2], self.w_up, offs))
        out = _grouped_mm(rows, self.w_down, offs) * weights.reshape(-1)[order].unsqueeze(-1)
        if self.back == "inverse":
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            out = out[inverse]
        if self.back == "index_add":
            moe = torch.zeros_like(flat).index_add(0, order // 2, out)
        else:
            moe = out.view(b * s, 2, 32).sum(1)
        return self.head((flat + moe).view(b, s, 32))


def _split_routed(model: _RoutedLM) -> fx.GraphModule:
    p = plan()
    return apply_pass(split_context_pass, capture_plan(p, model), p)


@pytest.mark.parametrize("back", ["inverse", "index_add"])
def test_rows_grouped_by_expert_are_each_ranks_own_tokens(back: str) -> None:
    """The router's top-k runs over the experts of each row, the sort and the count over
    the rank's rows only: every grouped product computes the rank's 2 · 16 of 2 · 32 rows,
    and nothing is reduced over cp."""
    gm = _split_routed(_RoutedLM(back))
    products = [n for n in gm.graph.nodes if "grouped_mm" in str(n.target)]
    assert [get_info(n).shapes[0][0] for n in products] == [32, 32]
    assert not calls(gm, context_reduce)
    inverses = [n for n in gm.graph.nodes if "argsort" in str(n.target)]
    assert len(inverses) == (back == "inverse")  # inverse[order] = arange(64): argsort(order)


@pytest.mark.parametrize("mix", ["cumsum", "softmax"])
def test_a_mix_of_the_flattened_tokens_is_refused(mix: str) -> None:
    with pytest.raises(CompileError, match=rf"\({mix}\).* mixes positions along the sequence"):
        _split_routed(_RoutedLM(mix=mix))


def test_a_reduction_of_the_flattened_tokens_other_than_sum_or_mean_is_refused() -> None:
    with pytest.raises(CompileError, match=r"\(amax\) .* turns a tensor split along the "
                                           r"sequence into one that is not .* other than by a "
                                           r"sum or mean"):
        _split_routed(_RoutedLM(mix="max"))


def test_a_mean_over_the_flattened_tokens_is_made_whole_over_cp() -> None:
    """Each rank's mean over its 2 · 8 tokens, averaged over cp: the mean of all 2 · 16."""
    gm = _split_routed(_RoutedLM(mix="mean"))
    (whole,) = calls(gm, context_reduce)
    assert whole.kwargs == {"mean": True} and "mean" in str(whole.args[0].target)


def test_rows_left_in_expert_order_are_refused() -> None:
    """Summing the grouped rows in pairs as if they were each token's two choices would add
    other tokens' rows on one rank and another's on the next."""
    with pytest.raises(CompileError, match=r"uses .*rows in the order of sort.* other than to "
                                           "group rows and put them back"):
        _split_routed(_RoutedLM(back="none"))


def test_a_load_balancing_loss_over_the_batch_is_made_whole_over_cp() -> None:
    """Mixtral trained on its loss plus its routers' load-balancing loss: each layer's
    count of top-2 choices per expert (histc) and sum of router probabilities per expert
    over the rank's tokens are summed over cp, so the loss is the whole batch's; the counts
    that give the grouped products their offsets stay the rank's own."""
    case = HFCase("mixtral_router_loss", cp=2)
    p = hf_plan(case)
    gm = apply_pass(split_context_pass, capture_plan(p, hf_module(case)), p)
    reduced = calls(gm, context_reduce)
    assert sorted(op_name(n.args[0]) for n in reduced) == ["histc", "histc", "sum", "sum"]
    assert all(n.kwargs == {"mean": False} for n in reduced)
    counts = [n.args[2].args[0] for n in gm.graph.nodes if "grouped_mm" in str(n.target)]
    assert {op_name(n) for n in counts} == {"histc"}  # offsets = cumsum(histc(...))
    assert not any(user.target is context_reduce for n in counts for user in n.users)
