"""The expert_parallel pass (shard_experts_pass) and the expert blocks it finds, in one process.

Real transformers MoE models from tiny configs are compiled at dp = 2, ep = 2
(`ptc.lower.driver.compile_plan`, nothing launched): one `ep_dispatch` /
`ep_combine` pair per MoE layer, every grouped product reading the
dispatch's rows and local offsets, the expert stacks cut to E/ep experts in
dim 0 (and by tp elsewhere), the Decisions' ExpertParallelLayout and the
stage layout's expert units (sharded over dp·cp/ep). Mixtral (softmax top-2),
GPT-OSS (per-expert biases gathered per row, which travel with the rows),
DeepSeek-V3 (a dense first layer left alone). Then the refusals, each naming
its plan field, and `find_expert_blocks` on a tiny hand-written MoE whose
expert body mixes rows. Numerical equivalence on several processes is in
tests/distributed/test_ep_equivalence.py.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests" / "distributed"):  # plain `pytest` puts neither on the path
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import transformers.integrations.moe  # noqa: E402,F401 - registers grouped_mm_fallback
from hf_helpers import HFCase, hf_module, hf_plan  # noqa: E402

from ptc.compiler.graph.meta import get_info, graph_record  # noqa: E402
from ptc.compiler.graph.moe_structure import find_expert_blocks  # noqa: E402
from ptc.compiler.graph.nodes import GROUPED_MM_OPS, op_name, param_source, walk  # noqa: E402
from ptc.compiler.records.ep_layout import EXPERT  # noqa: E402
from ptc.errors import CompileError, PlanError  # noqa: E402
from ptc.lower.driver import apply_pass, capture_plan, compile_plan  # noqa: E402
from ptc.compiler.records.program import Program  # noqa: E402
from ptc.ops.expert_parallel import ep_combine, ep_dispatch  # noqa: E402
from ptc.passes import shard_experts_pass  # noqa: E402
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec  # noqa: E402

pytestmark = pytest.mark.timeout(120)

EXPERTS = 4
"""Routed experts of every MoE layer of the tiny configs (transformers_models)."""


def moe_plan(model: str, *, dp: int = 2, ep: int = 2, tp: int = 1, zero: int = 0,
             offload: str = "none") -> Plan:
    """hf_plan's plan for `model` at this layout; global_batch 2·dp so that any dp divides it.
    Built by `dataclasses.replace`, so the Plan's checks run on the layout asked for."""
    base = hf_plan(HFCase(model))
    return dataclasses.replace(
        base, hardware=HardwareSpec.preset("cpu", gpus_per_node=tp * dp),
        parallel=dataclasses.replace(base.parallel, dp=dp, ep=ep, tp=tp, zero=zero,
                                     offload=offload),
        train=dataclasses.replace(base.train, global_batch=2 * dp))


@functools.cache
def compiled(model: str, tp: int = 1) -> Program:
    """`model` compiled at dp = 2, ep = 2 (and `tp`), once per test session."""
    return compile_plan(moe_plan(model, tp=tp), model=hf_module(HFCase(model)))


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def products(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if op_name(n) in GROUPED_MM_OPS]


def part(dispatch: fx.Node, index: int) -> fx.Node:
    """The getitem node taking output `index` of `dispatch` (0 rows, 1 local offsets, 2 route,
    3.. the row inputs)."""
    (node,) = [u for u in dispatch.users if u.args[1] == index]
    return node


def upstream(node: fx.Node) -> set[fx.Node]:
    return set(walk([node], lambda n: n.all_input_nodes))


def stage_graph(program: Program) -> fx.GraphModule:
    (stage,) = program.stages
    return stage.graph


def mixtral_stacks(layers=(0, 1)) -> list[str]:
    return [f"model.layers.{i}.mlp.experts.{w}" for i in layers
            for w in ("gate_up_proj", "down_proj")]


class TestMixtral:
    """Softmax top-2 routing over 4 experts in both layers, dp = 2, ep = 2."""

    def test_one_dispatch_and_one_combine_per_moe_layer(self) -> None:
        gm = stage_graph(compiled("mixtral"))
        dispatches, combines = calls(gm, ep_dispatch), calls(gm, ep_combine)
        assert len(dispatches) == len(combines) == 2
        assert sorted(get_info(n).layer for n in dispatches) == [0, 1]
        for dispatch in dispatches:
            assert dispatch.kwargs == {"experts": EXPERTS, "axis": "ep"}
            assert len(dispatch.args) == 2  # rows, offsets: Mixtral's body reads nothing else
            assert get_info(part(dispatch, 1)).shapes == ((EXPERTS // 2,),)
            assert get_info(part(dispatch, 2)).shapes == ((2, EXPERTS),)

    def test_every_grouped_product_reads_the_dispatched_rows_and_local_offsets(self) -> None:
        gm = stage_graph(compiled("mixtral"))
        dispatches = calls(gm, ep_dispatch)
        grouped = products(gm)
        assert len(grouped) == 4  # gate_up and down, per layer
        for product in grouped:
            # the offsets it groups by are the local ones of one dispatch
            (dispatch,) = [d for d in dispatches if product.args[2] is part(d, 1)]
            # its rows are that dispatch's rows (the first product) or computed from them
            assert part(dispatch, 0) in upstream(product.args[0]), product.format_node()
            assert dispatch.args[1] not in product.all_input_nodes
        for dispatch in dispatches:
            readers = [p for p in grouped if p.args[2] is part(dispatch, 1)]
            assert len(readers) == 2  # each layer's gate_up and down
            assert readers[0].args[0] is part(dispatch, 0)  # the first reads the rows as such

    def test_combine_takes_the_last_product_and_the_route(self) -> None:
        gm = stage_graph(compiled("mixtral"))
        for combine in calls(gm, ep_combine):
            last, route = combine.args
            assert op_name(last) in GROUPED_MM_OPS
            assert list(last.users) == [combine]  # nothing else reads the experts' rows
            assert route.args == (route.args[0], 2) and route.args[0].target is ep_dispatch
            assert route.args[0] in upstream(last)

    def test_the_stacks_hold_e_over_ep_experts(self) -> None:
        gm = stage_graph(compiled("mixtral"))
        params = dict(gm.named_parameters())
        for name in mixtral_stacks():
            assert params[name].shape[0] == EXPERTS // 2, name
        assert tuple(params["model.layers.0.mlp.experts.gate_up_proj"].shape) == (2, 128, 32)
        assert tuple(params["model.layers.0.mlp.experts.down_proj"].shape) == (2, 32, 64)
        assert tuple(params["model.layers.0.mlp.gate.weight"].shape) == (EXPERTS, 32)  # router
        for product in products(gm):  # the weight operand's recorded shape is the local one
            assert get_info(product.args[1]).shapes[0][0] == EXPERTS // 2, product.args[1].name

    def test_decisions_hold_the_stacks_with_full_shapes_and_the_layers(self) -> None:
        program = compiled("mixtral")
        layout = program.decisions.expert_parallel
        assert layout is not None and layout.ep == 2
        assert dict(layout.layers) == {0: EXPERTS, 1: EXPERTS}
        assert set(layout.params) == set(mixtral_stacks())
        shard = layout.params["model.layers.0.mlp.experts.gate_up_proj"]
        assert (shard.style, shard.dim, shard.full_shape) == (EXPERT, 0, (EXPERTS, 128, 32))
        assert shard.local_shape(2) == (2, 128, 32)
        assert layout.params["model.layers.1.mlp.experts.down_proj"].full_shape == (EXPERTS, 32, 64)
        assert layout.is_expert("model.layers.1.mlp.experts.down_proj")
        assert not layout.is_expert("model.layers.1.mlp.gate.weight")
        assert graph_record(stage_graph(program)).expert_parallel == layout

    def test_expert_units_are_sharded_over_dp_over_ep(self) -> None:
        program = compiled("mixtral")
        (stage,) = program.stages
        units = stage.layout.units
        experts = [u for u in units if u.expert]
        assert experts and all(u.shards == 2 // 2 for u in experts)
        assert all(u.shards == 2 for u in units if not u.expert)
        held = {p for u in experts for p in u.params}
        assert held == set(mixtral_stacks())
        assert not held & {p for u in units if not u.expert for p in u.params}

    def test_the_pass_log_counts_the_dispatches(self) -> None:
        lines = [line for line in compiled("mixtral").pass_log
                 if line.startswith("shard_experts_pass")]
        assert len(lines) == 1 and "inserted 2 ep_dispatch, 2 ep_combine" in lines[0], lines


class TestOtherRouters:
    def test_gpt_oss_row_gathered_bias_travels_with_the_rows(self) -> None:
        program = compiled("gpt_oss")
        gm = stage_graph(program)
        dispatches = calls(gm, ep_dispatch)
        assert len(dispatches) == 2
        for dispatch in dispatches:
            layer = get_info(dispatch).layer
            # rows, offsets and one row input: gate_up_proj_bias gathered by each row's expert
            assert len(dispatch.args) == 3, dispatch.format_node()
            assert len(dispatch.users) == 4  # rows, local offsets, route, the bias rows
            bias = dispatch.args[2]
            expected = f"model.layers.{layer}.mlp.experts.gate_up_proj_bias"
            assert param_source(bias.args[0]) == expected
            assert get_info(part(dispatch, 3)).shapes == get_info(bias).shapes
            # the body adds the dispatched bias rows, never the rank's own
            first = min((p for p in products(gm) if p.args[2] is part(dispatch, 1)),
                        key=lambda n: list(gm.graph.nodes).index(n))
            (add,) = first.users
            assert part(dispatch, 3) in add.all_input_nodes and bias not in add.all_input_nodes
        # the biases stay whole (gathered per row before the dispatch); the stacks are cut
        params = dict(gm.named_parameters())
        assert tuple(params["model.layers.0.mlp.experts.gate_up_proj_bias"].shape) == (EXPERTS, 128)
        assert tuple(params["model.layers.0.mlp.experts.gate_up_proj"].shape) == (2, 32, 128)
        assert set(program.decisions.expert_parallel.params) == set(mixtral_stacks())

    def test_deepseek_v3_dense_first_layer_is_left_alone(self) -> None:
        program = compiled("deepseek_v3")
        gm = stage_graph(program)
        dispatches, combines = calls(gm, ep_dispatch), calls(gm, ep_combine)
        assert len(dispatches) == len(combines) == 1
        assert get_info(dispatches[0]).layer == get_info(combines[0]).layer == 1
        layout = program.decisions.expert_parallel
        assert dict(layout.layers) == {1: EXPERTS}
        assert set(layout.params) == set(mixtral_stacks(layers=(1,)))
        params = dict(gm.named_parameters())
        assert tuple(params["model.layers.1.mlp.experts.gate_up_proj"].shape) == (2, 32, 32)
        # the dense MLP of layer 0 and the shared expert of layer 1 keep their shapes
        assert tuple(params["model.layers.0.mlp.gate_proj.weight"].shape) == (64, 32)
        assert tuple(params["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape) == (16, 32)
        assert not any(name.startswith("model.layers.0.") for name in layout.params)
        assert any("inserted 1 ep_dispatch" in line for line in program.pass_log)


class TestWithTensorParallel:
    """tp = 2, dp = 2, ep = 2: tp splits each stack within an expert, ep over the experts."""

    def test_stacks_are_split_by_both(self) -> None:
        program = compiled("mixtral", tp=2)
        gm = stage_graph(program)
        tp_layout, ep_layout = program.decisions.tensor_parallel, program.decisions.expert_parallel
        params = dict(gm.named_parameters())
        for name in mixtral_stacks():
            tp_shard = tp_layout.params[name]
            assert tp_shard.dim != 0  # tp never cuts across experts
            tp_local = tp_shard.local_shape(2)
            assert ep_layout.params[name].full_shape == tp_local  # ep's record is tp-local
            assert tuple(params[name].shape) == (EXPERTS // 2, *tp_local[1:]), name
        assert tuple(params["model.layers.0.mlp.experts.gate_up_proj"].shape) == (2, 64, 32)
        assert tuple(params["model.layers.0.mlp.experts.down_proj"].shape) == (2, 32, 32)
        assert len(calls(gm, ep_dispatch)) == len(calls(gm, ep_combine)) == 2
        (stage,) = program.stages
        assert all(u.shards == (1 if u.expert else 2) for u in stage.layout.units)


class TestRefusals:
    def test_ep_must_divide_the_experts(self) -> None:
        with pytest.raises(CompileError, match="does not divide the 4 routed experts") as info:
            compile_plan(moe_plan("mixtral", dp=3, ep=3), model=hf_module(HFCase("mixtral")))
        assert info.value.field == "parallel.ep"
        assert "parallel.ep = 3" in str(info.value)

    def test_a_model_without_routed_experts(self) -> None:
        with pytest.raises(CompileError, match="has no routed experts") as info:
            compile_plan(moe_plan("llama"), model=hf_module(HFCase("llama")))
        assert info.value.field == "parallel.ep"

    def test_ep_must_divide_dp_cp(self) -> None:
        with pytest.raises(PlanError, match=r"ep\(2\) must divide dp\(3\) \* cp\(1\) = 3") as info:
            moe_plan("mixtral", dp=3, ep=2)
        (d,) = info.value.diagnostics
        assert d.field == "parallel.ep" and set(d.choices) == {"1", "3"}

    def test_ep_with_offload(self) -> None:
        with pytest.raises(PlanError, match=r"ep\(2\) with offload = optimizer is not "
                                            r"supported") as info:
            moe_plan("mixtral", zero=2, offload="optimizer")
        assert [d.field for d in info.value.diagnostics] == ["parallel.offload"]

    def test_ep_with_zero_3_shards_the_expert_unit_over_its_own_ranks(self) -> None:
        program = compile_plan(moe_plan("mixtral", zero=3), model=hf_module(HFCase("mixtral")))
        assert len(calls(stage_graph(program), ep_dispatch)) == 2
        (stage,) = program.stages
        # each layer's experts a unit of their own, sharded over the dp/ep = 1 ranks holding them
        assert [(u.name, u.shards) for u in stage.layout.units if u.expert] == [
            ("model.layers.0.experts", 1), ("model.layers.1.experts", 1)]
        assert any(line.startswith("shard_params_pass") for line in program.pass_log)

    def test_ep_one_needs_no_experts(self) -> None:
        p = moe_plan("llama", ep=1)
        gm = capture_plan(p, hf_module(HFCase("llama")))
        assert apply_pass(shard_experts_pass, gm, p) is gm
        assert not calls(gm, ep_dispatch)


# --- a hand-written MoE: which bodies between the grouped products the pass can follow

def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' grouped product (x [N, in] by w [experts, in, out]): unlike
    torch's grouped_mm it has a meta kernel in fp32."""
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs)


class _TinyMoE(nn.Module):
    """Embedding, a softmax top-2 router over 4 experts (SwiGLU-free: up, `mix`, down), head.

    `mix` is what the body does between the two grouped products; `split_gate` adds a third
    product of the rows by a gate stack (torchtitan's `silu(x w1) * (x w3)`)."""

    def __init__(self, mix: str = "silu", split_gate: bool = False) -> None:
        super().__init__()
        self.mix, self.split_gate = mix, split_gate
        self.embed = nn.Embedding(64, 32)
        self.router = nn.Linear(32, EXPERTS, bias=False)
        self.w_up = nn.Parameter(torch.randn(EXPERTS, 32, 64) * 0.1)
        self.w_gate = nn.Parameter(torch.randn(EXPERTS, 32, 64) * 0.1) if split_gate else None
        self.w_down = nn.Parameter(torch.randn(EXPERTS, 64, 32) * 0.1)
        self.head = nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        x = self.embed(tokens)
        flat = x.reshape(b * s, 32)
        weights, ids = self.router(flat).softmax(-1).topk(2, dim=-1)
        sorted_ids, perm = ids.reshape(-1).sort()
        rows = flat[perm // 2]
        counts = torch.histc(sorted_ids.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = _grouped_mm(rows, self.w_up, offs)
        if self.split_gate:
            h = F.silu(_grouped_mm(rows, self.w_gate, offs)) * h
        h = {"silu": F.silu, "chunk": lambda t: t.chunk(2, dim=-1)[0].repeat(1, 2),
             "mean": lambda t: t - t.mean(0, keepdim=True),
             "cumsum": lambda t: t.cumsum(0), "flip": lambda t: t.flip(0),
             "softmax": lambda t: t.softmax(0), "dropout": lambda t: F.dropout(t, 0.1),
             "gather": lambda t: t[perm], "index_select": lambda t: t.index_select(0, perm),
             }[self.mix](h)
        out = _grouped_mm(h, self.w_down, offs) * weights.reshape(-1)[perm].unsqueeze(-1)
        y = torch.zeros_like(flat).index_add(0, perm // 2, out)
        return self.head(x + y.view(b, s, 32))


def _tiny_plan() -> Plan:
    return Plan(model=ModelSpec(family="gpt", layers=1, hidden=32, heads=4, vocab=64, max_seq=16),
                hardware=HardwareSpec.preset("cpu", gpus_per_node=2),
                parallel=ParallelSpec(dp=2, ep=2),
                train=TrainSpec(seq_len=16, global_batch=4, micro_batch=2, dtype="fp32"))


def _tiny(mix: str = "silu", **kw) -> fx.GraphModule:
    return capture_plan(_tiny_plan(), _TinyMoE(mix, **kw))


class TestExpertBlocks:
    @pytest.mark.parametrize("mix", ["silu", "chunk"])
    def test_a_row_wise_body_is_one_block(self, mix: str) -> None:
        gm = _tiny(mix)
        (block,) = find_expert_blocks(gm)
        assert [p.args[1].target for p in block.products] == ["w_up", "w_down"]
        assert block.stacks == ("w_up", "w_down") and block.experts == EXPERTS
        assert [p.kwargs["offs"] for p in block.products] == [block.offsets] * 2
        assert block.rows is block.products[0].args[0] and block.row_inputs == ()
        assert set(block.products) <= block.body and block.output is block.products[-1]
        gm = apply_pass(shard_experts_pass, gm, _tiny_plan())
        (dispatch,) = calls(gm, ep_dispatch)
        assert dispatch.args == (block.rows, block.offsets)
        assert tuple(gm.get_parameter("w_up").shape) == (EXPERTS // 2, 32, 64)

    @pytest.mark.parametrize("mix, what", [
        ("mean", "mean"), ("cumsum", "cumsum"), ("flip", "flip"), ("softmax", "softmax"),
        ("dropout", "dropout"),
    ])
    def test_a_body_op_that_mixes_rows_is_refused(self, mix: str, what: str) -> None:
        gm = _tiny(mix)
        message = f"{what}.* does not keep the routed rows apart"
        with pytest.raises(CompileError, match=message):
            find_expert_blocks(gm)
        with pytest.raises(CompileError, match=message) as info:
            compile_plan(_tiny_plan(), model=_TinyMoE(mix))
        assert info.value.field == "parallel.ep"

    @pytest.mark.parametrize("mix", ["gather", "index_select"])
    def test_a_gather_along_the_rows_is_refused(self, mix: str) -> None:
        gm = _tiny(mix)
        try:
            find_expert_blocks(gm)
        except CompileError as exc:
            assert "does not keep the routed rows apart" in str(exc)
        else:
            raise AssertionError(f"{mix} across the routed rows was accepted")

    def test_a_gate_and_an_up_product_of_the_same_rows_are_one_block(self) -> None:
        (block,) = find_expert_blocks(_tiny("silu", split_gate=True))
        assert set(block.stacks) == {"w_up", "w_gate", "w_down"}
        assert len(block.products) == 3

    def test_a_gate_and_an_up_product_are_never_sharded_apart(self) -> None:
        """Whatever the block finds, the pass either shards every stack the rows meet and
        sends the rows once, or refuses: never one stack cut and its sibling whole."""
        gm = _tiny("silu", split_gate=True)
        try:
            gm = apply_pass(shard_experts_pass, gm, _tiny_plan())
        except CompileError as exc:
            assert "expert parallelism" in str(exc)
            return
        assert len(calls(gm, ep_dispatch)) == 1
        for name in ("w_up", "w_gate", "w_down"):
            assert gm.get_parameter(name).shape[0] == EXPERTS // 2, name


def test_inspect_says_which_experts_each_ep_rank_holds() -> None:
    """`ptc inspect` names the dispatches and combines among the collectives and, per ep
    rank, its routed experts; DeepSeek-V3's dense first layer is not among the layers."""
    from ptc.views.inspect import experts_line, summary_line  # noqa: PLC0415

    assert "2 ep_dispatch, 2 ep_combine" in summary_line(compiled("mixtral"))
    assert experts_line(compiled("mixtral")) == (
        "experts: ep 2, each held by 1 rank; by ep rank: 0: 0-1, 1: 2-3 (of layers 0-1)")
    assert experts_line(compiled("deepseek_v3")).endswith("(of layers 1)")
