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
from torch import fx, nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from ptc.compiler.graph.meta import get_info  # noqa: E402
from ptc.errors import CompileError, PlanError  # noqa: E402
from ptc.lower.driver import apply_pass, capture_plan  # noqa: E402
from ptc.ops.context import context_attention, context_chunks  # noqa: E402
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
