"""The sequence_parallel pass (shard_sequence_pass) on small captured graphs.

Which tp all-reduces become reduce-scatter / all-gather along the sequence,
where replicated tensors enter the split sequence (scatter_seq), which
parameters get their gradient summed over tp (listed for the runtime), the local shapes
in the metadata, and the rewritten sequence lengths. Numerical equivalence
on several processes is in tests/distributed/test_tp_equivalence.py.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from pathlib import Path

import pytest
import torch
from torch import fx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from ptc.compiler.graph.meta import graph_record  # noqa: E402
from ptc.compiler.capture import capture  # noqa: E402
from ptc.compiler.graph.meta import get_info  # noqa: E402
from ptc.lower.driver import apply_pass, capture_plan  # noqa: E402
from ptc.errors import CompileError  # noqa: E402
from ptc.passes import shard_sequence_pass, shard_tensors_pass  # noqa: E402
from ptc.plan import (HardwareSpec, ModelSpec, ParallelSpec, Plan, ShardRule,  # noqa: E402
                      TrainSpec)
from ptc.ops.tp_ops import (all_gather_seq, copy_to_tp, gather_seq,  # noqa: E402
                            reduce_from_tp, reduce_scatter_seq, scatter_seq)
from tests.user_models.nanogpt import nanogpt  # noqa: E402

pytestmark = pytest.mark.timeout(120)

GPT = ModelSpec(family="gpt", layers=2, hidden=32, heads=4, vocab=64, max_seq=16)
LLAMA = ModelSpec(family="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64,
                  max_seq=16)


def plan(model: ModelSpec = GPT, *, tp: int = 2, sp: bool = True, seq: int = 16) -> Plan:
    return Plan(model=model, hardware=HardwareSpec.preset("cpu", gpus_per_node=tp),
                parallel=ParallelSpec(tp=tp, sequence_parallel=sp),
                train=TrainSpec(seq_len=seq, global_batch=2, micro_batch=2, dtype="fp32"))


def lowered(p: Plan, gm: fx.GraphModule | None = None) -> fx.GraphModule:
    gm = gm if gm is not None else capture_plan(p)
    return apply_pass(shard_sequence_pass, apply_pass(shard_tensors_pass, gm, p), p)


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def param_copies(gm: fx.GraphModule) -> list[str]:
    return sorted(str(n.args[0].target) for n in calls(gm, copy_to_tp))


class TestShardSequencePass:
    def test_gpt_all_reduces_become_sequence_collectives(self, caplog):
        with caplog.at_level("INFO", logger="ptc.passes"):
            gm = lowered(plan(GPT))
        assert len(calls(gm, all_gather_seq)) == 5  # before qkv, up (x2 layers) and the head
        assert len(calls(gm, reduce_scatter_seq)) == 5  # after o, down (x2) and the embedding
        assert not calls(gm, reduce_from_tp)
        assert len(calls(gm, scatter_seq)) == 1  # learned positions meet the split sequence
        assert "inserted 5 all_gather_seq, 5 reduce_scatter_seq, 1 scatter_seq" in caplog.text
        assert "14 parameters of the split sequence get their gradients summed over tp once " \
            "per step" in caplog.text

    def test_collectives_split_the_sequence_dim(self):
        gm = lowered(plan(GPT))
        for op in (all_gather_seq, reduce_scatter_seq):
            assert all(n.args[1] == 1 for n in calls(gm, op))
        (scatter,) = calls(gm, scatter_seq)
        assert scatter.args == (node(gm, "pos_embed"), 0)  # [s, h]: the sequence is dim 0

    def test_parameters_on_the_split_sequence_are_listed_for_one_tp_sum_per_step(self):
        gm = lowered(plan(GPT))
        assert sorted(graph_record(gm).tensor_parallel.partial_grads) == sorted(
            [f"layers.{i}.{m}.{w}" for i in range(2) for m in ("attn_norm", "mlp_norm")
             for w in ("weight", "bias")]
            + [f"layers.{i}.{m}.bias" for i in range(2) for m in ("attn.o", "mlp.down")]
            + ["norm.bias", "norm.weight"])
        assert param_copies(gm) == []  # no per-use collective on a parameter
        norm = node(gm, "layers_0_attn_norm")  # the LayerNorm module became F.layer_norm
        assert norm.target is torch.nn.functional.layer_norm
        assert norm.args[2].op == "get_attr" and norm.args[2].target == "layers.0.attn_norm.weight"

    def test_meta_shapes_are_split_along_the_sequence(self):
        gm = lowered(plan(GPT))
        assert get_info(node(gm, "layers_0_attn_norm")).shapes == ((2, 8, 32),)
        gathered = node(gm, "layers_0_attn_qkv").args[0]
        assert gathered.target is all_gather_seq
        assert get_info(gathered).shapes == ((2, 16, 32),)
        assert get_info(node(gm, "layers_0_attn_qkv")).shapes == ((2, 16, 48),)
        scattered = next(iter(node(gm, "layers_0_attn_o").users))
        assert scattered.target is reduce_scatter_seq
        assert get_info(scattered).shapes == ((2, 8, 32),)
        assert get_info(node(gm, "head")).shapes == ((2, 16, 32),)

    def test_sequence_lengths_read_off_split_tensors_are_the_whole_sequence(self):
        """GPT reads (b, s) off the norm's output, which is now s / tp long; s is folded to
        the 16 positions it measured, which the gathered q, k, v hold."""
        gm = lowered(plan(GPT))
        view = node(gm, "view")
        assert view.args[1:] == (2, 16, 2, 8)  # (b, s, heads / tp, d)
        assert not any(n.op == "call_method" and n.target == "size" for n in gm.graph.nodes)

    def test_llama_needs_no_scatter(self):
        gm = lowered(plan(LLAMA))
        assert len(calls(gm, all_gather_seq)) == 5
        assert len(calls(gm, reduce_scatter_seq)) == 5
        assert not calls(gm, scatter_seq)
        assert sorted(graph_record(gm).tensor_parallel.partial_grads) == sorted(
            [f"layers.{i}.{m}.weight" for i in range(2) for m in ("attn_norm", "mlp_norm")]
            + ["norm.weight"])
        assert node(gm, "layers_0_attn_norm").target is torch.nn.functional.rms_norm

    def test_user_model(self):
        with torch.device("meta"):
            model = nanogpt(n_layer=1, n_head=4, n_embd=32, vocab_size=64, block_size=16)
        gm = lowered(plan(GPT), capture(model, micro_batch=2, seq_len=16))
        assert len(calls(gm, scatter_seq)) == 1  # wpe(pos) added to the split token embedding
        merge = node(gm, "view_3")  # y.view(B, T, C): T whole (gathered), C // 2 (tp heads)
        assert merge.args[1:3] == (2, 16)
        assert merge.args[3].target is operator.floordiv

    def test_off_without_the_option_or_with_tp1(self):
        p = plan(GPT, sp=False)
        gm = apply_pass(shard_tensors_pass, capture_plan(p), p)
        code = gm.code
        assert apply_pass(shard_sequence_pass, gm, p) is gm and gm.code == code
        p1 = plan(GPT, tp=1)
        gm1 = capture_plan(p1)
        assert apply_pass(shard_sequence_pass, gm1, p1) is gm1

    def test_needs_the_tensor_parallel_pass_first(self):
        p = plan(GPT)
        with pytest.raises(CompileError, match="run the tensor_parallel pass first"):
            apply_pass(shard_sequence_pass, capture_plan(p), p)

    @pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
    def test_an_attention_kept_whole_by_a_rule_runs_on_the_gathered_sequence(self, model):
        """Its q, k and v come from the rank's part of the sequence: each is gathered whole
        (gather_seq) before the attention, which would otherwise attend within the part, and
        the output projection's result enters the split sequence again (scatter_seq)."""
        whole = dataclasses.replace(plan(model).parallel, shards=(
            ShardRule(pattern="layers.*.attn.*", style="replicate"),))
        p = dataclasses.replace(plan(model), parallel=whole)
        gm = lowered(p)
        gathers = calls(gm, gather_seq)
        assert len(gathers) == 3 * model.layers
        for g in gathers:  # whole along the sequence: 16 positions of [b, heads, s, d]
            assert 16 in get_info(g).shapes[0] and get_info(g.args[0]).shapes[0] != \
                get_info(g).shapes[0]
        outputs = [n for n in calls(gm, scatter_seq) if "attn.o" in str(n.args[0].target)]
        assert len(outputs) == model.layers
        partial = graph_record(gm).tensor_parallel.partial_grads
        # q, k, v read the rank's tokens (their gradients summed over tp); o runs whole.
        assert "layers.0.attn.o.weight" not in partial
        assert any(name.startswith("layers.0.attn.q") for name in partial)

    def test_a_table_sliced_to_the_sequence_length_spans_the_whole_sequence(self):
        """Llama's rotary tables are narrowed to the length of q; q holds the rank's part of
        the sequence, but the rank's part of the table is not its first rows: the length
        is folded to the whole sequence and the table enters through scatter_seq."""
        whole = dataclasses.replace(plan(LLAMA).parallel, shards=(
            ShardRule(pattern="layers.*.attn.*", style="replicate"),))
        p = dataclasses.replace(plan(LLAMA), parallel=whole)
        gm = lowered(p)
        narrows = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.narrow]
        assert narrows and all(n.args[3] == 16 for n in narrows)
        assert all(any(u.target is scatter_seq for u in n.users)
                   or any(v.target is scatter_seq for u in n.users for v in u.users)
                   for n in narrows)

    def test_sequence_not_divisible(self):
        p = plan(GPT, tp=4, seq=14)
        with pytest.raises(CompileError, match="the 14 positions a rank holds are not divisible by tp = 4"):
            lowered(p)
