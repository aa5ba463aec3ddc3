"""fuse_column_parallel_linears (ptc.passes.tp_overlap) and its ops, in one process.

Which tp entry collectives (copy_to_tp, all_gather_seq) and linears become
one column_parallel_linears[_seq] call, in plain graphs, checkpoint regions,
ZeRO-3 graphs and pipeline stages; what is left alone; the metadata of the
created nodes; and, with no tp group bound, that the fused graph's loss and
every gradient equal the unfused graph's (observed: GPT identical, Llama
within 1e-8 absolute: q, k and v's input gradients are summed in another
order). Equivalence on gloo processes is in
tests/distributed/test_tp_overlap_equivalence.py.
"""

from __future__ import annotations

import copy
import operator
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from ptc.views.inspect import collective  # noqa: E402
from ptc.compiler.graph.meta import get_info  # noqa: E402
from ptc.compiler.graph.nodes import module_of  # noqa: E402
from ptc.lower.driver import capture_plan, lower_graph, pass_list  # noqa: E402
from ptc.compiler.graph.stage_graphs import pipeline_stages  # noqa: E402
from ptc.models import build_model  # noqa: E402
from ptc.passes import (checkpoint_layers_pass, shard_params_pass,  # noqa: E402
                        shard_sequence_pass, shard_tensors_pass, split_pipeline_pass)
from ptc.passes.checkpoint_layers import REGION_PREFIX  # noqa: E402
from ptc.passes.tp_overlap import fuse_column_parallel_linears  # noqa: E402
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec  # noqa: E402
from ptc.ops import tp_ops  # noqa: E402
from ptc.ops.tp_ops import (all_gather_seq, column_parallel_linears,  # noqa: E402
                                column_parallel_linears_seq, copy_to_tp)
from tests.tolerances import assert_loss_and_grads_match, assert_within_rounding  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LAYERS = 2
GPT = ModelSpec(family="gpt", layers=LAYERS, hidden=32, heads=4, vocab=64, max_seq=16)
LLAMA = ModelSpec(family="llama", layers=LAYERS, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64,
                  max_seq=16)
SPECS = {"gpt": GPT, "llama": LLAMA}
# Column-parallel linears per entry: GPT's fused qkv, up; Llama's q, k, v, then gate, up.
PER_LAYER = {"gpt": (("qkv",), ("up",)), "llama": (("q", "k", "v"), ("gate", "up"))}
TP_PASSES = (shard_tensors_pass, shard_sequence_pass)
FUSED = (column_parallel_linears, column_parallel_linears_seq)


def plan(family: str, *, sp: bool = False, pp: int = 1, zero: int = 0,
         checkpoint_policy: str = "none") -> Plan:
    return Plan(model=SPECS[family], hardware=HardwareSpec.preset("cpu", gpus_per_node=2 * pp),
                parallel=ParallelSpec(tp=2, pp=pp, sequence_parallel=sp, zero=zero,
                                      checkpoint=checkpoint_policy),
                train=TrainSpec(seq_len=16, global_batch=2 * pp, micro_batch=2, dtype="fp32"))


def lowered(p: Plan, passes=TP_PASSES) -> fx.GraphModule:
    return lower_graph(capture_plan(p), p, pass_list(*passes))[1].graph


def calls(gm: fx.GraphModule, *targets) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def entries(gm: fx.GraphModule) -> list[fx.Node]:
    """copy_to_tp / all_gather_seq nodes on activations (not on parameters)."""
    return [n for n in calls(gm, copy_to_tp, all_gather_seq) if n.args[0].op != "get_attr"]


def fused_linears(gm: fx.GraphModule) -> list[list[str]]:
    """Per fused node, the names of the getitem nodes standing for its linears."""
    return [sorted(u.name for u in n.users) for n in calls(gm, *FUSED)]


def is_linear(node: fx.Node) -> bool:
    return isinstance(module_of(node), nn.Linear) or node.target is F.linear


def expected_linears(family: str) -> list[list[str]]:
    groups = [[f"layers_{i}_{part}_{leaf}" for leaf in leaves]
              for i in range(LAYERS) for part, leaves in zip(("attn", "mlp"), PER_LAYER[family])]
    return sorted(sorted(g) for g in [*groups, ["head"]])


class TestFusion:
    @pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
    @pytest.mark.parametrize("family", list(SPECS))
    def test_every_entry_and_its_linears_become_one_fused_op(self, family, sp):
        gm = lowered(plan(family, sp=sp))
        before = entries(gm)
        assert len(before) == 2 * LAYERS + 1
        assert fuse_column_parallel_linears(gm) == len(before)
        assert not entries(gm)
        assert not calls(gm, copy_to_tp)
        fused = calls(gm, *FUSED)
        assert {n.target for n in fused} == {column_parallel_linears_seq if sp
                                             else column_parallel_linears}
        assert sorted(fused_linears(gm)) == expected_linears(family)
        assert all(u.target is operator.getitem for n in fused for u in n.users)
        if sp:
            assert all(n.kwargs == {"dim": 1, "axis": "tp"} for n in fused)
        # What is left of the linears: the row-parallel o and down of every layer.
        rest = [n.name for n in gm.graph.nodes if is_linear(n)]
        assert sorted(rest) == sorted(f"layers_{i}_{m}" for i in range(LAYERS)
                                      for m in ("attn_o", "mlp_down"))

    def test_weights_become_get_attr_nodes_in_linear_order(self):
        gm = lowered(plan("llama"))
        fuse_column_parallel_linears(gm)
        attn = next(n for n in calls(gm, column_parallel_linears)
                    if "layers_0_attn_q" in {u.name for u in n.users})
        x, weights, biases = attn.args
        assert x.name == "layers_0_attn_norm"
        assert [w.target for w in weights] == [f"layers.0.attn.{p}.weight" for p in "qkv"]
        assert biases == (None, None, None)
        assert attn.kwargs == {"axis": "tp"}
        gpt = lowered(plan("gpt"))
        fuse_column_parallel_linears(gpt)
        qkv = next(n for n in calls(gpt, column_parallel_linears)
                   if "layers_0_attn_qkv" in {u.name for u in n.users})
        assert [b.target for b in qkv.args[2]] == ["layers.0.attn.qkv.bias"]

    def test_meta_of_created_nodes(self):
        gm = lowered(plan("llama"))
        linears = {n.name: get_info(n) for n in gm.graph.nodes
                   if n.name in ("layers_0_attn_q", "layers_0_attn_k", "layers_0_attn_v")}
        entry = get_info(next(iter(entries(gm))))
        fuse_column_parallel_linears(gm)
        fused = next(n for n in calls(gm, column_parallel_linears)
                     if "layers_0_attn_q" in {u.name for u in n.users})
        info = get_info(fused)
        assert info.kind == "linear" and info.module_path == entry.module_path
        assert info.layer == 0
        assert info.shapes == tuple(linears[f"layers_0_attn_{p}"].shapes[0] for p in "qkv")
        assert info.flops == sum(i.flops for i in linears.values())
        assert info.params == sum(i.params for i in linears.values())
        for item in fused.users:
            assert get_info(item) == linears[item.name]  # the linear's record, same name
        assert all(get_info(w).kind == "param" for w in fused.args[1])

    def test_second_call_finds_nothing(self):
        gm = lowered(plan("gpt", sp=True))
        assert fuse_column_parallel_linears(gm) == 2 * LAYERS + 1
        code = gm.code
        assert fuse_column_parallel_linears(gm) == 0 and gm.code == code

    def test_entry_read_by_another_node_is_left_alone(self):
        gm = lowered(plan("gpt"))
        entry = entries(gm)[0]
        with gm.graph.inserting_after(entry):
            gm.graph.call_function(torch.relu, (entry,))
        assert fuse_column_parallel_linears(gm) == 2 * LAYERS
        assert entry in entries(gm)

    def test_inspect_labels_the_fused_ops(self):
        gm = lowered(plan("gpt", sp=True))
        fuse_column_parallel_linears(gm)
        forward, backward = collective(calls(gm, column_parallel_linears_seq)[0])
        assert forward == "all-gather" and "reduce-scatter (async" in backward
        assert column_parallel_linears.ptc_collective == (
            "identity", "all-reduce (async, overlaps weight gradients)")


class TestAfterLaterPasses:
    def test_checkpoint_regions_are_fused_inside(self):
        p = plan("llama", sp=True, checkpoint_policy="full")
        gm = lowered(p, (*TP_PASSES, checkpoint_layers_pass))
        regions = {name: r for name, r in gm.named_children() if name.startswith(REGION_PREFIX)}
        assert len(regions) == LAYERS
        assert fuse_column_parallel_linears(gm) == 2 * LAYERS + 1
        assert len(calls(gm, *FUSED)) == 1  # the head, outside the layers
        for region in regions.values():
            assert len(calls(region, column_parallel_linears_seq)) == 2
            assert not calls(region, all_gather_seq)
            assert all(w.op == "placeholder" for n in calls(region, *FUSED) for w in n.args[1])

    def test_zero3_linears_read_weight_views(self):
        p = plan("gpt", zero=3)
        gm = lowered(p, (shard_tensors_pass, shard_params_pass))
        assert fuse_column_parallel_linears(gm) == 2 * LAYERS + 1
        for node in calls(gm, column_parallel_linears):
            assert all(w.op == "call_method" and w.target == "view" for w in node.args[1])

    def test_each_pipeline_stage_is_fused(self):
        p = plan("llama", pp=2)
        gm = lowered(p, (*TP_PASSES, split_pipeline_pass))
        stages = pipeline_stages(gm)
        assert len(stages) == 2
        assert fuse_column_parallel_linears(gm) == 2 * LAYERS + 1
        assert [len(calls(s, column_parallel_linears)) for _, s in stages] == [2, 3]


# ----------------------------------------------------------------- numerics


def materialized(gm: fx.GraphModule, spec: ModelSpec) -> fx.GraphModule:
    """The lowered graph on CPU: the model's buffers (RoPE tables), seeded random parameters."""
    buffers = dict(build_model(spec, device="cpu", seed=1).named_buffers())
    gm = gm.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, b in gm.named_buffers():
            b.copy_(buffers[name])
        for _, param in gm.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return gm


def loss_and_grads(gm: fx.GraphModule, tokens, targets):
    params = dict(gm.named_parameters())
    loss = gm(tokens, targets)
    return loss, dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


@pytest.mark.parametrize("policy", ["none", "full"])
@pytest.mark.parametrize("family", list(SPECS))
def test_fused_graph_trains_like_the_unfused_one(family, policy):
    """No tp group bound: every op is local, the graph runs as one rank's program would."""
    p = plan(family, checkpoint_policy=policy)
    unfused = materialized(lowered(p, (*TP_PASSES, checkpoint_layers_pass)), p.model)
    fused = copy.deepcopy(unfused)
    assert fuse_column_parallel_linears(fused) == 2 * LAYERS + 1
    tokens, targets = torch.randint(0, 64, (2, 2, 16), generator=torch.Generator().manual_seed(2))
    loss, grads = loss_and_grads(fused, tokens, targets)
    ref_loss, ref_grads = loss_and_grads(unfused, tokens, targets)
    assert grads.keys() == ref_grads.keys()
    # The unfused graph in float64 is the tolerances' exact result, but for its
    # vocab-parallel cross-entropy, which computes in fp32 (as under bf16).
    exact = loss_and_grads(copy.deepcopy(unfused).double(), tokens, targets)
    assert_loss_and_grads_match((loss, grads), (ref_loss, ref_grads), exact,
                                f"{family} checkpoint={policy}", tokens.numel())


class TestOpInOneProcess:
    """With no tp group bound the fused ops equal F.linear on a shared input."""

    @staticmethod
    def _inputs(dtype):
        gen = torch.Generator().manual_seed(4)
        x = torch.randn(2, 6, 8, generator=gen).to(dtype).requires_grad_()
        weights = [torch.randn(o, 8, generator=gen).to(dtype).requires_grad_() for o in (4, 2, 2)]
        biases = [torch.randn(4, generator=gen).to(dtype).requires_grad_(), None,
                  torch.randn(2, generator=gen).to(dtype).requires_grad_()]
        return x, weights, biases

    @staticmethod
    def _grads(outs, x, weights, biases):
        loss = sum((o.to(torch.promote_types(o.dtype, torch.float32)) * (i + 1)).square().sum()
                   for i, o in enumerate(outs))
        leaves = [x, *weights, *(b for b in biases if b is not None)]
        return torch.autograd.grad(loss, leaves)

    @classmethod
    def _exact_grads(cls, x, weights, biases):
        """The linears' gradients in float64 from the same inputs: the tolerances' exact ones."""
        x, weights, biases = ([t if t is None else t.detach().double().requires_grad_()
                               for t in ts] for ts in ([x], weights, biases))
        return cls._grads([F.linear(x[0], w, b) for w, b in zip(weights, biases)], x[0], weights,
                          biases)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("op", FUSED, ids=lambda op: op.__name__)
    def test_outputs_and_gradients_equal_linears(self, op, dtype):
        x, weights, biases = self._inputs(dtype)
        ours = op(x, tuple(weights), tuple(biases))
        ref = [F.linear(x, w, b) for w, b in zip(weights, biases)]
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        got, want = self._grads(ours, x, weights, biases), self._grads(ref, x, weights, biases)
        exact = self._exact_grads(x, weights, biases)
        for i, (a, b, e) in enumerate(zip(got, want, exact)):
            assert a.dtype == b.dtype == dtype
            if dtype == torch.float32:
                assert_within_rounding(a, b, e, f"{op.__name__}: gradient {i}")
            else:  # bf16: input gradients are summed in one fp32 accumulator (addmm) instead of
                # rounding each product first: equal to within bf16 rounding of the largest value.
                torch.testing.assert_close(a, b, rtol=0, atol=2 ** -8 * b.abs().max().item())

    def test_under_non_reentrant_checkpoint(self):
        x, weights, biases = self._inputs(torch.float32)
        outs = checkpoint(lambda x: column_parallel_linears(x, tuple(weights), tuple(biases)), x,
                          use_reentrant=False)
        ref = [F.linear(x, w, b) for w, b in zip(weights, biases)]
        for i, (a, b, e) in enumerate(zip(self._grads(outs, x, weights, biases),
                                          self._grads(ref, x, weights, biases),
                                          self._exact_grads(x, weights, biases))):
            assert_within_rounding(a, b, e, f"under checkpoint: gradient {i}")

    def test_only_needed_gradients_are_computed(self):
        x, weights, biases = self._inputs(torch.float32)
        frozen = weights[1].detach()
        outs = column_parallel_linears(x.detach(), (weights[0], frozen, weights[2]),
                                       tuple(biases))
        sum(o.sum() for o in outs).backward()
        assert x.grad is None and weights[1].grad is None
        assert weights[0].grad is not None and biases[2].grad is not None

    def test_weights_are_saved_through_saved_tensor_hooks(self):
        """ZeRO-3's session sees the weights (it keeps gathered ones as references)."""
        x, weights, biases = self._inputs(torch.float32)
        packed = []

        def pack(t):
            packed.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            column_parallel_linears(x, tuple(weights), tuple(biases))
        assert [id(t) for t in packed] == [id(x), *map(id, weights)]

    @pytest.mark.parametrize("op", FUSED, ids=lambda op: op.__name__)
    def test_weight_gradients_are_computed_while_the_input_gradient_travels(self, op,
                                                                          monkeypatch):
        """A fake 2-rank group records when collectives start and are waited for."""
        events = []

        class Fake:
            def __init__(self, name, out):
                self.name, self.out = name, out
                events.append(f"start {name}")

            def wait(self):
                events.append(f"wait {self.name}")
                return self.out

        def weight_grad(grad, x):
            events.append("dW")
            return real_weight_grad(grad, x)

        real_weight_grad = tp_ops._weight_grad
        monkeypatch.setattr(tp_ops, "axis_group", lambda axis: "tp group")
        monkeypatch.setattr(tp_ops, "group_size", lambda group: 2)
        monkeypatch.setattr(tp_ops, "all_reduce_flat", lambda f, g: Fake("all-reduce", f))
        def into(out, value):  # the result written where the caller asked, as the real ops do
            return value if out is None else out.copy_(value)

        monkeypatch.setattr(tp_ops, "all_gather_flat",
                            lambda f, g, out=None: Fake("gather", into(out, f.repeat(2))))
        monkeypatch.setattr(tp_ops, "reduce_scatter_flat",
                            lambda f, g, out=None: Fake("reduce-scatter",
                                                        into(out, f[:f.numel() // 2])))
        monkeypatch.setattr(tp_ops, "_weight_grad", weight_grad)
        x, weights, biases = self._inputs(torch.float32)
        outs = op(x, tuple(weights), tuple(biases))
        events.clear()  # forward's all-gather (sequence parallel)
        sum(o.sum() for o in outs).backward()
        if op is column_parallel_linears:
            assert events == ["start all-reduce", "dW", "dW", "dW", "wait all-reduce"]
        else:  # the chunk is gathered again while dL/dx is computed
            assert events == ["start gather", "start reduce-scatter", "wait gather",
                              "dW", "dW", "dW", "wait reduce-scatter"]

    def test_mismatched_biases_are_an_error(self):
        x, weights, _ = self._inputs(torch.float32)
        with pytest.raises(ValueError, match="one bias"):
            column_parallel_linears(x, tuple(weights), (None,))

