"""The ZeRO-3 pass (shard_params_pass) and the pass runner, on small captured graphs."""

from __future__ import annotations

import copy
import operator
import sys
from pathlib import Path

import pytest
import torch
from torch import fx, nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from ptc.compiler.graph.meta import get_info  # noqa: E402
from ptc.compiler.records.graph_meta import GraphRecord  # noqa: E402
from ptc.compiler.graph.meta import graph_info, set_graph_record  # noqa: E402
from ptc.lower.driver import PASSES, apply_pass, capture_plan, compile_graph, lower_graph, pass_list  # noqa: E402
from ptc.compiler.graph.params import ZeroShards, param_layout  # noqa: E402
from ptc.errors import CompileError  # noqa: E402
from ptc.models import build_model  # noqa: E402
from ptc.passes import shard_params_pass  # noqa: E402
from ptc.plan import (HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec)  # noqa: E402
from ptc.ops.collectives import gather_params, gather_params_start  # noqa: E402
from tests.tolerances import assert_loss_within_rounding  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def plan(family: str = "gpt", *, zero: int = 3, dp: int = 2, overlap: bool = True,
         layers: int = 2) -> Plan:
    model = (ModelSpec(family="gpt", layers=layers, hidden=32, heads=4, vocab=64, max_seq=16)
             if family == "gpt" else
             ModelSpec(family="llama", layers=layers, hidden=32, heads=4, kv_heads=2, ffn=64,
                       vocab=64, max_seq=16))
    return Plan(model=model, hardware=HardwareSpec.preset("cpu", gpus_per_node=dp),
                parallel=ParallelSpec(dp=dp, zero=zero, overlap=overlap),
                train=TrainSpec(seq_len=16, global_batch=2 * dp, micro_batch=2, dtype="fp32"))


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


class TestShardParamsPass:
    def test_inserts_one_gather_per_group_and_logs_it(self, caplog):
        p = plan("gpt", layers=3)
        gm = capture_plan(p)
        with caplog.at_level("INFO", logger="ptc.passes"):
            gm = apply_pass(shard_params_pass, gm, p)
        # embed, pos_embed, 3 layers, norm, head (tied to embed: gathered again)
        assert len(calls(gm, gather_params)) == 7
        assert len(calls(gm, gather_params_start)) == 7
        assert "inserted 7 gather_params" in caplog.text

    def test_only_shards_remain_as_parameters(self):
        p = plan("llama")
        gm = apply_pass(shard_params_pass, capture_plan(p), p)
        names = [n for n, _ in gm.named_parameters()]
        assert isinstance(gm.zero, ZeroShards)
        assert names == [f"zero.shard_{i}" for i in range(len(gm.zero.layout.units))]
        assert not any(n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear)
                       for n in gm.graph.nodes)

    def test_shards_are_one_dp_slice_of_each_unit(self):
        p = plan("gpt", dp=4)
        gm = apply_pass(shard_params_pass, capture_plan(p), p)
        for i, unit in enumerate(gm.zero.layout.units):
            assert getattr(gm.zero, f"shard_{i}").shape == (unit.shard_numel,)
            assert unit.shard_numel * 4 >= unit.numel > (unit.shard_numel - 1) * 4

    def test_tied_head_gathers_the_embedding_unit_again(self):
        p = plan("gpt")
        gm = apply_pass(shard_params_pass, capture_plan(p), p)
        gathers = calls(gm, gather_params)
        shard_targets = [tuple(a.target for a in g.args[1]) for g in gathers]
        assert shard_targets[0] == ("zero.shard_0",)  # embed
        assert shard_targets[-1] == ("zero.shard_0",)  # head reads embed.weight
        assert gm.zero.layout.params["embed.weight"].aliases == ("embed.weight", "head.weight")

    @pytest.mark.parametrize("overlap", [True, False])
    def test_each_start_sits_just_before_its_wait(self, overlap):
        # When to issue a gather is the comm_overlap pass's decision, not this pass's.
        p = plan("gpt", overlap=overlap)
        gm = apply_pass(shard_params_pass, capture_plan(p), p)
        for start in calls(gm, gather_params_start):
            assert start.next.target is gather_params and start.next.args[0] is start

    def test_created_nodes_keep_the_source_provenance(self):
        p = plan("llama")
        gm = apply_pass(shard_params_pass, capture_plan(p), p)
        layer1 = [g for g in calls(gm, gather_params)
                  if get_info(g) is not None and get_info(g).layer == 1]
        assert len(layer1) == 1
        info = get_info(layer1[0])
        assert info.module_path.startswith("layers.1") and info.flops == 0
        view = next(n for n in gm.graph.nodes if n.name == "layers_1_attn_q_weight")
        assert get_info(view).kind == "view" and get_info(view).shapes == ((32, 32),)
        linear = next(n for n in view.users)
        assert linear.target is torch.nn.functional.linear
        assert get_info(linear).module_path == "layers.1.attn.q"

    def test_lowered_graph_computes_the_same_loss(self):
        p = plan("llama", dp=1)
        model = build_model(p.model, device="cpu", seed=1)
        tokens = torch.randint(0, 64, (2, 16))
        targets = torch.randint(0, 64, (2, 16))
        expected, exact = (nn.functional.cross_entropy(m(tokens).flatten(0, 1), targets.flatten())
                           for m in (model, copy.deepcopy(model).double()))
        gm = capture_plan(p, model)
        layout = param_layout(gm, 1)
        state = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        gm = apply_pass(shard_params_pass, gm, p)
        for i, unit in enumerate(layout.units):
            flat = torch.cat([state[n].detach().reshape(-1) for n in unit.params])
            gm.zero.register_parameter(f"shard_{i}", nn.Parameter(flat))
        for name, value in buffers.items():
            owner, _, leaf = name.rpartition(".")
            if hasattr(gm.get_submodule(owner) if owner else gm, leaf):
                (gm.get_submodule(owner) if owner else gm)._buffers[leaf] = value
        loss = gm(tokens, targets)
        assert_loss_within_rounding(loss, expected, exact, "ZeRO-3 graph", tokens.numel())
        loss.backward()  # without a session, gradients land on the shards
        assert all(s.grad is not None for s in gm.zero.parameters())

    def test_below_zero_3_the_graph_is_untouched(self):
        p = plan("gpt", zero=2)
        gm = capture_plan(p)
        before = str(gm.graph)
        assert apply_pass(shard_params_pass, gm, p) is gm and str(gm.graph) == before

    def test_unsupported_leaf_module_is_named(self):
        class Scale(nn.Module):
            def __init__(self):
                super().__init__()
                self.s = nn.Parameter(torch.ones(4))

            def forward(self, x):
                return x * self.s

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
                self.conv = nn.Conv1d(4, 4, 1)

            def forward(self, x, t):
                return self.conv(self.lin(x).unsqueeze(-1)).sum()

        gm = fx.symbolic_trace(M())
        # A hand-traced graph: give it the record capture would (any captured graph's info).
        set_graph_record(gm, GraphRecord(capture=graph_info(capture_plan(plan("gpt")))))
        with pytest.raises(CompileError, match=r"conv \(Conv1d\).*Linear, Embedding"):
            apply_pass(shard_params_pass, gm, plan("gpt"))


class TestRunPasses:
    def test_failing_pass_is_named_with_the_passes_before_it(self):
        def first_pass(gm, decisions):
            return gm

        def broken_pass(gm, decisions):
            raise ValueError("boom")

        p = plan_ = plan("gpt", zero=0)
        with pytest.raises(CompileError, match=r"pass broken_pass failed \(passes run before it: "
                                               r"first_pass\): ValueError: boom"):
            lower_graph(capture_plan(p), plan_, pass_list(first_pass, broken_pass))

    def test_dump_dir_gets_the_graph_after_each_pass(self, tmp_path, monkeypatch):
        monkeypatch.setenv("PTC_DUMP_DIR", str(tmp_path))
        p = plan("gpt")
        program = compile_graph(capture_plan(p), p)
        files = sorted(f.name for f in tmp_path.iterdir())
        after = [f"{i:02d}_{name}.txt" for i, name in enumerate(PASSES.names(), start=1)]
        assert files == ["00_captured.txt", *after]
        zero_dump = next(f for f in after if "shard_params_pass" in f)
        assert "gather_params" in (tmp_path / zero_dump).read_text()
        assert "gather_params" not in (tmp_path / "00_captured.txt").read_text()
        assert "shard_params_pass: inserted 6 gather_params" in program.pass_log

    def test_knobs_reach_their_pass(self):
        p = plan("gpt")
        gm = lower_graph(capture_plan(p), p, knobs={"overlap_collectives_pass": {"prefetch": 0}})[1].graph
        for start in calls(gm, gather_params_start):
            assert start.next.target is gather_params

    def test_getitem_views_slice_the_unit_buffer(self):
        p = plan("gpt")
        gm = apply_pass(shard_params_pass, capture_plan(p), p)
        view = next(n for n in gm.graph.nodes if n.name == "layers_0_attn_qkv_weight")
        piece = view.args[0]
        assert piece.target is operator.getitem and isinstance(piece.args[1], slice)
        slot = gm.zero.layout.params["layers.0.attn.qkv.weight"]
        assert piece.args[1] == slice(slot.offset, slot.offset + slot.numel)



def test_a_transformers_models_layers_are_gathered_one_at_a_time() -> None:
    """A transformers model's blocks sit under "model.layers": each is a unit of its own, as
    a built-in's "layers.N" is, so ZeRO-3 gathers one layer's weights at a time, not the
    whole decoder ("model") at once; the embedding and final norm, outside the blocks, share
    "model"."""
    sys.path.insert(0, str(ROOT / "tests" / "distributed"))
    from hf_helpers import HFCase, hf_module, hf_plan  # noqa: PLC0415

    from ptc.lower.driver import compile_plan  # noqa: PLC0415

    case = HFCase("llama", dp=2, zero=3)
    (stage,) = compile_plan(hf_plan(case), model=hf_module(case)).stages
    assert [u.name for u in stage.layout.units] == [
        "model", "model.layers.0", "model.layers.1", "lm_head"]
