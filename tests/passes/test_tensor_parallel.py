"""The tensor_parallel pass (shard_tensors_pass) on small captured graphs, and its ops in one process.

What is split (parameters' local shapes and ParamShards), which collectives
are inserted where, with what metadata, which shape arguments are rewritten,
what the plan's shard rules change, and the errors for structures the pass
cannot split. Numerical equivalence on several processes is in
tests/distributed/test_tp_equivalence.py.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from ptc.compiler.graph.meta import graph_record  # noqa: E402
from ptc.compiler.capture import capture  # noqa: E402
from ptc.compiler.graph.meta import get_info  # noqa: E402
from ptc.lower.driver import apply_pass, capture_plan, compile_graph  # noqa: E402
from ptc.models import build_model  # noqa: E402
from ptc.models.layers import make_mlp  # noqa: E402
from ptc.models.llama import LlamaAttention  # noqa: E402
from ptc.compiler.records.tp_layout import ParamShard  # noqa: E402
from ptc.errors import CompileError  # noqa: E402
from ptc.passes import shard_tensors_pass  # noqa: E402
from ptc.passes.cat_form import to_cat_form  # noqa: E402
from ptc.compiler.graph.nodes import is_linear, op_name  # noqa: E402
from ptc.compiler.graph.tp_structure import find_sharding  # noqa: E402
from ptc.plan import (HardwareSpec, ModelSpec, ParallelSpec, Plan, ShardRule,  # noqa: E402
                      TrainSpec)
from ptc.ops.tp_ops import (copy_to_tp, reduce_from_tp, tp_part,  # noqa: E402
                            vocab_parallel_cross_entropy, vocab_parallel_embedding)
from tests.tolerances import assert_loss_within_rounding, assert_within_rounding  # noqa: E402
from tests.user_models.nanogpt import nanogpt  # noqa: E402

pytestmark = pytest.mark.timeout(120)

GPT = ModelSpec(family="gpt", layers=2, hidden=32, heads=4, vocab=64, max_seq=16)
LLAMA = ModelSpec(family="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64,
                  max_seq=16)


def plan(model: ModelSpec = GPT, *, tp: int = 2, dp: int = 1, zero: int = 0,
         shards: tuple[ShardRule, ...] = ()) -> Plan:
    return Plan(model=model, hardware=HardwareSpec.preset("cpu", gpus_per_node=tp * dp),
                parallel=ParallelSpec(tp=tp, dp=dp, zero=zero, shards=shards),
                train=TrainSpec(seq_len=16, global_batch=2 * dp, micro_batch=2, dtype="fp32"))


def lowered(p: Plan, model: nn.Module | None = None) -> fx.GraphModule:
    gm = capture(model, micro_batch=2, seq_len=16) if model is not None else capture_plan(p)
    return apply_pass(shard_tensors_pass, gm, p)


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def tiny_nanogpt() -> nn.Module:
    with torch.device("meta"):
        return nanogpt(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16)


class TestShardTensorsPass:
    def test_gpt_collectives_and_log(self, caplog):
        with caplog.at_level("INFO", logger="ptc.passes"):
            gm = lowered(plan(GPT))
        # Per layer: one copy before qkv, one before up; one more before the head. One
        # reduce after o and down per layer, and one after the vocabulary-parallel embedding.
        assert len(calls(gm, copy_to_tp)) == 5
        assert len(calls(gm, reduce_from_tp)) == 5
        assert len(calls(gm, vocab_parallel_embedding)) == 1
        assert len(calls(gm, vocab_parallel_cross_entropy)) == 1
        assert not any(op is F.cross_entropy for op in (n.target for n in gm.graph.nodes))
        assert "inserted 5 copy_to_tp, 5 reduce_from_tp; split 4 linears colwise, 4 rowwise, " \
               "2 vocab-parallel (embed, head)" in caplog.text

    def test_collectives_sit_where_megatron_puts_them(self):
        gm = lowered(plan(GPT))
        copy = node(gm, "layers_0_attn_qkv").args[0]
        assert copy.target is copy_to_tp and copy.args[0].name == "layers_0_attn_norm"
        o = node(gm, "layers_0_attn_o")  # now F.linear(x, w, None): the bias comes after the sum
        assert o.target is F.linear and o.args[2] is None
        (reduced,) = o.users
        assert reduced.target is reduce_from_tp
        (add,) = reduced.users
        assert add.target is operator.add and add.args[1].target == "layers.0.attn.o.bias"
        head_input = node(gm, "head").args[0]
        assert head_input.target is copy_to_tp and head_input.args[0].name == "norm"

    def test_parameters_get_local_shapes_and_a_layout(self):
        gm = lowered(plan(GPT))
        shapes = {n: tuple(p.shape) for n, p in gm.named_parameters()}
        assert shapes["layers.0.attn.qkv.weight"] == (48, 32)
        assert shapes["layers.0.attn.qkv.bias"] == (48,)
        assert shapes["layers.0.attn.o.weight"] == (32, 16)
        assert shapes["layers.0.attn.o.bias"] == (32,)  # row-parallel bias: replicated
        assert shapes["layers.0.mlp.up.weight"] == (64, 32)
        assert shapes["layers.0.mlp.down.weight"] == (32, 64)
        assert shapes["embed.weight"] == (32, 32)
        assert shapes["pos_embed.weight"] == (16, 32)  # indexed by positions: replicated
        assert shapes["layers.0.attn_norm.weight"] == (32,)
        assert gm.embed.weight is gm.head.weight  # tied: one shard shared
        layout = graph_record(gm).tensor_parallel
        assert layout.tp == 2
        assert layout.params["layers.0.attn.qkv.weight"] == ParamShard(
            style="colwise", dim=0, segments=(32, 32, 32), full_shape=(96, 32))
        assert layout.params["layers.0.attn.o.weight"].dim == 1
        assert layout.params["head.weight"] == layout.params["embed.weight"]
        assert "layers.0.attn.o.bias" not in layout.params
        assert "pos_embed.weight" not in layout.params

    def test_fused_qkv_rank_gets_its_own_q_k_and_v_heads(self):
        shard = graph_record(lowered(plan(GPT))).tensor_parallel.params["layers.0.attn.qkv.weight"]
        full = torch.arange(96.0).unsqueeze(1).expand(96, 32)
        rows = shard.local(full, 1, 2)[:, 0].long().tolist()
        assert rows == [*range(16, 32), *range(48, 64), *range(80, 96)]  # q, k, v heads 2, 3
        parts = [shard.local(full, r, 2) for r in range(2)]
        assert torch.equal(shard.join(parts), full)

    def test_a_vocabulary_not_divisible_by_tp_is_padded_with_rows_no_token_reaches(self):
        odd = dataclasses.replace(GPT, vocab=63)
        gm = lowered(plan(odd))
        shard = graph_record(gm).tensor_parallel.params["embed.weight"]
        assert (shard.segments, shard.pad, shard.full_shape) == ((64,), 1, (63, 32))
        assert tuple(gm.embed.weight.shape) == (32, 32)
        full = torch.arange(63.0).unsqueeze(1).expand(63, 32)
        parts = [shard.local(full, r, 2) for r in range(2)]
        assert parts[1][-1].eq(0).all() and parts[1][-2, 0] == 62  # the padding row is zero
        assert torch.equal(shard.join(parts), full)
        (loss,) = calls(gm, vocab_parallel_cross_entropy)
        assert loss.kwargs["vocab_size"] == 63  # the padding logit is left out of the loss
        (flat,) = node(gm, "head").users
        assert flat.args == (node(gm, "head"), -1, 32)  # logits [b·s, ceil(V / tp)]

    def test_head_counts_and_split_sizes_are_rewritten(self):
        gm = lowered(plan(GPT))
        split = node(gm, "split")
        assert split.args[1] == [16, 16, 16]
        assert node(gm, "view").args[3:] == (2, 8)  # 4 heads -> 2 per rank, head size kept
        assert node(gm, "reshape").args[-1] == 16  # merge: 32 -> 16 features
        (flat,) = node(gm, "head").users
        assert flat.args == (node(gm, "head"), -1, 32)  # logits [b·s, V / tp]

    def test_node_meta_is_local(self):
        gm = lowered(plan(GPT))
        qkv = get_info(node(gm, "layers_0_attn_qkv"))
        full = get_info(node(capture_plan(plan(GPT)), "layers_0_attn_qkv"))
        assert qkv.shapes == ((2, 16, 48),)
        assert qkv.flops * 2 == full.flops
        assert qkv.params * 2 == full.params
        copy = get_info(node(gm, "layers_0_attn_qkv").args[0])
        assert copy.kind == "other" and copy.module_path == "layers.0.attn.qkv"
        assert copy.shapes == ((2, 16, 32),) and copy.flops == 0
        assert get_info(node(gm, "embed")).kind == "embedding"
        assert get_info(node(gm, "layers_0_attn_o")).shapes == ((2, 16, 32),)

    def test_llama_grouped_query_attention(self):
        gm = lowered(plan(LLAMA))
        shapes = {n: tuple(p.shape) for n, p in gm.named_parameters()}
        assert shapes["layers.0.attn.q.weight"] == (16, 32)  # 2 of 4 query heads
        assert shapes["layers.0.attn.k.weight"] == (8, 32)   # 1 of 2 key/value heads
        assert shapes["layers.0.mlp.gate.weight"] == (32, 32)
        assert shapes["layers.0.mlp.up.weight"] == (32, 32)
        assert shapes["layers.0.mlp.down.weight"] == (32, 32)
        assert shapes["head.weight"] == (32, 32)
        assert node(gm, "view_1").args[3:] == (1, 8)
        sdpa = next(n for n in gm.graph.nodes if get_info(n).kind == "attention")
        assert get_info(sdpa).shapes == ((2, 2, 16, 8),)
        # q, k and v read one copy of the norm's output: one all-reduce in backward.
        q, k, v = (node(gm, f"layers_0_attn_{x}") for x in "qkv")
        assert q.args[0] is k.args[0] is v.args[0]
        assert len(calls(gm, copy_to_tp)) == 5

    def test_layers_that_differ_get_their_own_local_shapes(self):
        """Identical layers share one meta evaluation per call; these differ and must not."""
        model = build_model(LLAMA, device="meta")
        with torch.device("meta"):
            model.layers[1].mlp = make_mlp(dataclasses.replace(LLAMA, ffn=128), "swiglu", False)
            model.layers[1].attn = LlamaAttention(dataclasses.replace(LLAMA, kv_heads=4), False)
        gm = lowered(plan(LLAMA), model)
        assert get_info(node(gm, "layers_0_mlp_up")).shapes == ((2, 16, 32),)
        assert get_info(node(gm, "layers_1_mlp_up")).shapes == ((2, 16, 64),)
        assert get_info(node(gm, "layers_0_attn_k")).shapes == ((2, 16, 8),)
        assert get_info(node(gm, "layers_1_attn_k")).shapes == ((2, 16, 16),)
        assert node(gm, "view_1").args[3:] == (1, 8)  # layer 0: 2 kv heads -> 1 per rank
        assert node(gm, "view_4").args[3:] == (2, 8)  # layer 1: 4 kv heads -> 2 per rank

    def test_user_model_sizes_read_from_tensors(self):
        """nanoGPT reads C from x.size() and splits by n_embd: both rewritten."""
        gm = lowered(plan(GPT), tiny_nanogpt())
        view = node(gm, "view")
        assert view.args[3] == 2  # n_head constant
        merge = node(gm, "view_3")  # y.view(B, T, C): C // 2 inserted
        assert merge.args[3].target is operator.floordiv and merge.args[3].args[1] == 2
        assert node(gm, "split").args[1] == 16
        layout = graph_record(gm).tensor_parallel
        assert layout.params["transformer.h.0.attn.c_attn.weight"].segments == (32, 32, 32)
        assert gm.transformer.wte.weight is gm.lm_head.weight
        ce = calls(gm, vocab_parallel_cross_entropy)[0]
        assert ce.kwargs == {"ignore_index": -1, "reduction": "mean"}

    def test_tp1_leaves_the_graph_alone(self):
        gm = capture_plan(plan(GPT, tp=1))
        code = gm.code
        assert apply_pass(shard_tensors_pass, gm, plan(GPT, tp=1)) is gm and gm.code == code
        assert graph_record(gm).tensor_parallel is None

    def test_program_and_zero_see_local_shapes(self):
        p = plan(LLAMA, dp=2, zero=3)
        program = compile_graph(capture_plan(p), p)
        assert program.tensor_parallel.params["layers.0.attn.q.weight"].full_shape == (32, 32)
        assert program.layout.params["layers.0.attn.q.weight"].shape == (16, 32)
        assert [m.split(":")[0] for m in program.pass_log] == [
            "shard_tensors_pass", "shard_params_pass", "overlap_collectives_pass"]


class TestMixtureOfExperts:
    """Mixtral's experts: stacks of weights [experts, out, in] applied by a grouped product."""

    def test_experts_split_as_mlps_and_the_router_stays_whole(self):
        from tests.user_models.transformers_models import mixtral  # noqa: PLC0415

        torch.manual_seed(0)
        model = mixtral()
        p = plan(ModelSpec(family="custom", factory="tests.user_models.transformers_models:"
                           "mixtral", vocab=64, max_seq=16))
        gm = capture(model, micro_batch=2, seq_len=16)
        found = find_sharding(gm, p)
        experts = "model.layers.0.mlp.experts"
        assert found.styles[f"{experts}.gate_up_proj"] == "colwise"
        assert found.styles[f"{experts}.down_proj"] == "rowwise"
        assert found.why["model.layers.0.mlp.gate"].startswith("MoE router")
        gm = apply_pass(shard_tensors_pass, gm, p)
        shard = graph_record(gm).tensor_parallel.params[f"{experts}.gate_up_proj"]
        # each rank: its half of every expert's gate rows and of its up rows
        assert (shard.dim, shard.segments) == (1, (64, 64))
        assert tuple(gm.get_parameter(f"{experts}.gate_up_proj").shape) == (4, 64, 32)
        assert tuple(gm.get_parameter(f"{experts}.down_proj").shape) == (4, 32, 32)
        assert tuple(gm.get_parameter("model.layers.0.mlp.gate.weight").shape) == (4, 32)
        down = next(n for n in gm.graph.nodes if is_linear(n) == f"{experts}.down_proj")
        assert [u.target for u in down.users] == [reduce_from_tp]


def _deepseek_v3(**config) -> tuple[fx.GraphModule, Plan]:
    """DeepSeek-V3's tiny graph (4 heads, q/kv latents of 16, a rotary key of 4 features per
    head, experts in layer 1) as the pass meets it, and a tp 2 plan for it."""
    from tests.user_models.transformers_models import deepseek_v3  # noqa: PLC0415

    torch.manual_seed(0)
    p = plan(ModelSpec(family="custom", factory="tests.user_models.transformers_models:"
                       "deepseek_v3", kwargs=config, vocab=64, max_seq=16))
    return capture(deepseek_v3(**config), micro_batch=2, seq_len=16), p


class TestLatentAttention:
    """DeepSeek-V3's multi-head latent attention, split as Megatron-Core splits MLA."""

    attn = "model.layers.0.self_attn"

    def test_down_projections_whole_up_projections_by_heads(self):
        gm, p = _deepseek_v3()
        to_cat_form(gm)  # as the pass does first: its keys filled in place become a cat
        found = find_sharding(gm, p)
        styles = {name: found.styles[f"{self.attn}.{name}"] for name in (
            "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")}
        assert styles == {"q_a_proj": "replicate", "kv_a_proj_with_mqa": "replicate",
                          "q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"}
        assert found.why[f"{self.attn}.q_a_proj"].startswith("low-rank projection")
        assert found.why["model.layers.1.mlp.gate"].startswith("MoE router")  # sigmoid + bias
        (shared, _) = found.shared_heads  # one per layer: the rotary key k_pe
        (entry,) = shared.entries  # k_pe's piece of kv_a_proj_with_mqa's output
        assert op_name(entry) == "getitem" and is_linear(entry.args[0].args[0]) == \
            f"{self.attn}.kv_a_proj_with_mqa"

    def test_each_rank_expands_the_rotary_key_to_its_own_heads(self):
        gm, p = _deepseek_v3()
        gm = apply_pass(shard_tensors_pass, gm, p)
        shapes = {name: tuple(gm.get_parameter(f"{self.attn}.{name}.weight").shape) for name in (
            "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")}
        assert shapes == {"q_a_proj": (16, 32), "kv_a_proj_with_mqa": (20, 32),
                          "q_b_proj": (16, 16), "kv_b_proj": (24, 16), "o_proj": (32, 16)}
        # per layer: one copy_to_tp before q_b_proj, one before kv_b_proj, one for k_pe
        copies = [n for n in calls(gm, copy_to_tp)
                  if get_info(n).module_path.startswith(self.attn)]
        assert [op_name(c.args[0]) for c in copies] == ["mul", "getitem", "view"]
        sdpa = next(n for n in gm.graph.nodes if get_info(n).kind == "attention")
        k_nope, k_pe = sdpa.args[1].args[0]  # the keys: a cat of the rank's heads
        assert op_name(k_pe) == "expand" and k_pe.args[1] == [-1, 2, -1, -1]
        assert get_info(k_nope).shapes == get_info(k_pe).shapes == ((2, 2, 16, 4),)
        # the latents' norms run whole outside the split region: their gradients are whole
        assert graph_record(gm).tensor_parallel.partial_grads == ()

    def test_a_rule_keeping_the_attention_whole_keeps_its_rotary_key_whole(self):
        gm, p = _deepseek_v3()
        rules = (ShardRule(pattern="model.layers.*.self_attn.*", style="replicate"),)
        gm = apply_pass(shard_tensors_pass, gm, dataclasses.replace(
            p, parallel=dataclasses.replace(p.parallel, shards=rules)))
        assert tuple(gm.get_parameter(f"{self.attn}.kv_b_proj.weight").shape) == (48, 16)
        k_pe = next(n for n in gm.graph.nodes if op_name(n) == "expand"
                    and get_info(n).shapes == ((2, 4, 16, 4),))
        assert k_pe.args[1] == [-1, 4, -1, -1]

    def test_queries_without_a_latent(self):
        """q_lora_rank = None: the queries come from one q_proj, split by heads."""
        gm, p = _deepseek_v3(q_lora_rank=None)
        gm = apply_pass(shard_tensors_pass, gm, p)
        assert tuple(gm.get_parameter(f"{self.attn}.q_proj.weight").shape) == (16, 32)
        assert tuple(gm.get_parameter(f"{self.attn}.kv_a_proj_with_mqa.weight").shape) == (20, 32)


class TestShardRules:
    def test_replicate_rule_keeps_modules_whole(self):
        rules = (ShardRule(pattern="layers.*.mlp.*", style="replicate"),)
        gm = lowered(plan(GPT, shards=rules))
        assert tuple(gm.get_parameter("layers.0.mlp.up.weight").shape) == (128, 32)
        assert tuple(gm.get_parameter("layers.1.mlp.down.weight").shape) == (32, 128)
        assert tuple(gm.get_parameter("layers.0.attn.qkv.weight").shape) == (48, 32)
        assert len(calls(gm, copy_to_tp)) == 3 and len(calls(gm, reduce_from_tp)) == 3
        found = find_sharding(capture_plan(plan(GPT)), plan(GPT, shards=rules))
        assert found.why["layers.1.mlp.up"] == 'rule "layers.*.mlp.*" replicate'
        assert found.why["layers.1.attn.qkv"] == "attention q/k/v (split by heads)"
        assert find_sharding(capture_plan(plan(GPT)), plan(GPT)).why["layers.1.mlp.down"] == \
            "MLP output projection"
        assert found.styles["pos_embed"] == "replicate"

    def test_replicated_vocabulary(self):
        rules = (ShardRule(pattern="embed", style="replicate"),
                 ShardRule(pattern="head", style="replicate"))
        gm = lowered(plan(GPT, shards=rules))
        assert tuple(gm.get_parameter("embed.weight").shape) == (64, 32)
        assert not calls(gm, vocab_parallel_cross_entropy)

    def test_tied_weight_split_two_ways_is_an_error(self):
        rules = (ShardRule(pattern="embed", style="replicate"),)
        with pytest.raises(CompileError, match=r"embed.weight is split over tp, but node embed"):
            lowered(plan(GPT, shards=rules))

    def test_rule_styles_must_fit_the_module(self):
        rules = (ShardRule(pattern="pos_embed", style="colwise"),)
        with pytest.raises(CompileError, match="'pos_embed' can only be vocab or replicate"):
            lowered(plan(GPT, shards=rules))
        rules = (ShardRule(pattern="layers.0.mlp.up", style="vocab"),)
        with pytest.raises(CompileError, match="can only be colwise or rowwise or replicate"):
            lowered(plan(GPT, shards=rules))
        gm = lowered(plan(GPT, shards=(ShardRule(pattern="head", style="colwise"),)))
        assert len(calls(gm, vocab_parallel_cross_entropy)) == 1  # a colwise head is the vocab one

    def test_rule_matching_nothing_is_an_error(self):
        rules = (ShardRule(pattern="layers.*.ffn", style="colwise"),)
        with pytest.raises(CompileError, match=r"shard rules match no linear.*layers\.\*\.ffn"):
            lowered(plan(GPT, shards=rules))


class NormInMLP(nn.Module):
    """An MLP with a LayerNorm between its projections: not a column -> row chain."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 64)
        self.mid = nn.LayerNorm(64)
        self.down = nn.Linear(64, 32)
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.down(self.mid(self.up(x))))


class TestUnshardable:
    def test_error_names_module_node_and_the_fixing_rule(self):
        with pytest.raises(CompileError) as err:
            lowered(plan(GPT), NormInMLP())
        text = str(err.value)
        assert "linear 'up' (node up): its output reaches layer_norm" in text \
            or "linear 'up' (node up): its output reaches LayerNorm" in text
        assert 'shard "up" replicate' in text and 'shard "down" replicate' in text

    def test_the_suggested_rules_fix_it(self):
        rules = (ShardRule(pattern="up", style="replicate"),
                 ShardRule(pattern="down", style="replicate"))
        gm = lowered(plan(GPT, shards=rules), NormInMLP())
        assert len(calls(gm, vocab_parallel_cross_entropy)) == 1
        assert tuple(gm.get_parameter("up.weight").shape) == (64, 32)

    def test_forcing_a_split_through_the_norm_is_caught(self):
        rules = (ShardRule(pattern="up", style="colwise"),
                 ShardRule(pattern="down", style="rowwise"))
        with pytest.raises(CompileError, match="node mid .*cannot run on the rank-local shapes"):
            lowered(plan(GPT, shards=rules), NormInMLP())

    def test_kv_heads_that_tp_neither_splits_nor_replicates(self):
        spec = ModelSpec(family="llama", layers=1, hidden=48, heads=6, ffn=96, vocab=66,
                         max_seq=16)  # the plan checks would refuse kv_heads = 2 with tp = 3
        model = build_model(spec, device="meta")
        with torch.device("meta"):
            model.layers[0].attn = LlamaAttention(dataclasses.replace(spec, kv_heads=2), False)
        with pytest.raises(CompileError, match=r"2 key/value heads and tp = 3: neither divides"):
            lowered(plan(spec, tp=3), model)
        rules = (ShardRule(pattern="layers.*.attn.*", style="replicate"),)
        gm = lowered(plan(spec, tp=3, shards=rules), model)
        assert tuple(gm.get_parameter("layers.0.attn.k.weight").shape) == (16, 48)
        assert tuple(gm.get_parameter("layers.0.mlp.up.weight").shape) == (32, 48)

    def test_fewer_kv_heads_than_tp_are_replicated(self):
        """2 key/value heads over tp = 4: k and v stay whole, each rank takes the one head its
        two query heads read where they meet, and their weights' gradients are partial."""
        odd = ModelSpec(family="llama", layers=1, hidden=32, heads=4, kv_heads=2, ffn=64,
                        vocab=64, max_seq=16)
        p = plan(odd, tp=4)
        gm = apply_pass(shard_tensors_pass, capture_plan(p), p)
        assert tuple(gm.get_parameter("layers.0.attn.q.weight").shape) == (8, 32)
        assert tuple(gm.get_parameter("layers.0.attn.k.weight").shape) == (16, 32)
        parts = calls(gm, tp_part)
        assert [n.args[1:] for n in parts] == [(1, 2, 4), (1, 2, 4)]
        sdpa = next(n for n in gm.graph.nodes if get_info(n).kind == "attention")
        assert sdpa.args[1:3] == tuple(parts)
        assert get_info(parts[0]).shapes == ((2, 1, 16, 8),)
        q, k, v = (node(gm, f"layers_0_attn_{x}") for x in "qkv")
        assert q.args[0] is k.args[0] is v.args[0]  # one copy_to_tp: dL/dx summed once
        layout = graph_record(gm).tensor_parallel
        assert set(layout.partial_grads) == {"layers.0.attn.k.weight", "layers.0.attn.v.weight"}
        assert "layers.0.attn.k.weight" not in layout.params

    def test_tp_part_keeps_the_heads_of_the_rank(self):
        """Rank r of 4 over 2 pieces keeps piece r // 2; its gradient is zero elsewhere."""
        x = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3).requires_grad_()
        out = tp_part(x, 1, 2, 4)  # one process: rank 0
        assert torch.equal(out, x[:, :1])
        out.sum().backward()
        assert torch.equal(x.grad, torch.stack([torch.ones(2, 3), torch.zeros(2, 3)], 1))


class TestOpsInOneProcess:
    """With no tp group bound every op is local and equals its plain torch counterpart."""

    def test_vocab_parallel_cross_entropy_equals_torch(self):
        torch.manual_seed(0)
        logits = torch.randn(12, 10, requires_grad=True)
        targets = torch.randint(0, 10, (12,))
        targets[3] = -1
        logits64 = logits.detach().double().requires_grad_()  # the exact result, for tolerances
        for reduction in ("mean", "sum", "none"):
            ours = vocab_parallel_cross_entropy(logits, targets, ignore_index=-1,
                                                reduction=reduction)
            ref, exact = (F.cross_entropy(z, targets, ignore_index=-1, reduction=reduction)
                          for z in (logits, logits64))
            # A mean or sum over the counted rows; "none" gives each row's own loss.
            rows = int((targets != -1).sum()) if ref.dim() == 0 else 1
            assert_loss_within_rounding(ours, ref, exact, reduction, rows)
            g_ours, = torch.autograd.grad(ours.sum(), logits)
            g_ref, = torch.autograd.grad(ref.sum(), logits)
            g_exact, = torch.autograd.grad(exact.sum(), logits64)
            assert_within_rounding(g_ours, g_ref, g_exact, f"{reduction}: gradient")

    def test_vocab_parallel_embedding_equals_torch(self):
        weight = torch.randn(10, 4, requires_grad=True)
        tokens = torch.tensor([[1, 2, 2, 9]])
        out = vocab_parallel_embedding(tokens, weight)
        # A lookup, and a gradient of small integers: exact, nothing is rounded.
        torch.testing.assert_close(out, F.embedding(tokens, weight), rtol=0, atol=0)
        (out * torch.arange(4.0)).sum().backward()
        expected = torch.zeros(10, 4)
        for t in tokens[0]:
            expected[t] += torch.arange(4.0)
        torch.testing.assert_close(weight.grad, expected, rtol=0, atol=0)

    def test_copy_and_reduce_are_identities(self):
        x = torch.randn(3, requires_grad=True)
        y = reduce_from_tp(copy_to_tp(x))
        torch.testing.assert_close(y, x, rtol=0, atol=0)  # identities: exact
        y.sum().backward()
        torch.testing.assert_close(x.grad, torch.ones(3), rtol=0, atol=0)
