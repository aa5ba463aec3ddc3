"""Attention with sinks (transformers' GPT-OSS): per-head logits joined to each row of the
scores before the softmax, whose column the probabilities then drop. ptc finds it as an
attention (`nodes.attention_parts`: its profile, memory and step time, its recompute
regions) and refuses, in one line naming the sinks, the splits it cannot make of it: by
heads (tensor parallelism, which would leave each rank all heads' sinks) and along the
sequence (context parallelism). A softmax whose column is dropped without sinks is not
taken for one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests" / "distributed"):  # plain `pytest` puts neither on the path
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from hf_helpers import HFCase, hf_module, hf_plan  # noqa: E402

from ptc.compiler.capture import capture  # noqa: E402
from ptc.compiler.graph.nodes import attention_parts, node_shape, op_name  # noqa: E402
from ptc.compiler.search.estimate import estimate  # noqa: E402
from ptc.errors import CompileError  # noqa: E402
from ptc.lower.driver import compile_plan  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _attentions(model: torch.nn.Module) -> list:
    gm = capture(model, micro_batch=1, seq_len=8, dtype=torch.float32)
    return [parts for n in gm.graph.nodes if (parts := attention_parts(n)) is not None]


def test_each_layer_s_attention_is_found_with_its_sinks() -> None:
    model = hf_module(HFCase("gpt_oss"))
    found = _attentions(model)
    config = model.config
    assert len(found) == config.num_hidden_layers
    for parts in found:
        assert not parts.fused and parts.sinks is not None
        assert node_shape(parts.q)[-3:] == (config.num_attention_heads, 8, config.head_dim)
        # The sinks enter as [batch, heads, queries, 1]: one logit per head and query row.
        assert node_shape(parts.sinks) == (1, config.num_attention_heads, 8, 1)


def test_a_dropped_column_without_sinks_is_no_attention() -> None:
    def plain(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v

    def clipped(q, k, v):
        probs = torch.softmax(q @ k.transpose(-2, -1), dim=-1)[..., :-1]
        return probs @ v[..., :-1, :]

    q = torch.randn(1, 2, 8, 4)
    found = {}
    for fn in (plain, clipped):  # aten ops, as a captured graph holds them
        gm = make_fx(fn)(q, q, q)
        assert [n for n in gm.graph.nodes if op_name(n) == "softmax"]
        found[fn.__name__] = [n for n in gm.graph.nodes if attention_parts(n) is not None]
    assert len(found["plain"]) == 1 and not found["clipped"]


def test_the_model_is_priced() -> None:
    est = estimate(hf_plan(HFCase("gpt_oss", dp=2)))
    assert est.step_time_s > 0 and est.peak_memory_bytes > 0


@pytest.mark.parametrize("case,pattern", [
    (HFCase("gpt_oss", tp=2), r"self_attn\.q_proj.*joins per-head sink logits to the scores "
                              r"\(attention sinks\), which tensor parallelism does not split"),
    (HFCase("gpt_oss", cp=2), r"context parallelism: the attention at .* joins per-head sink "
                              r"logits to its scores \(attention sinks\)"),
])
def test_splits_it_cannot_make_are_refused_naming_the_sinks(case: HFCase, pattern: str) -> None:
    with pytest.raises(CompileError, match=pattern):
        compile_plan(hf_plan(case), model=hf_module(case))
