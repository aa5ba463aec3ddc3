"""The comm_overlap pass: buckets, ZeRO-3 gather scheduling, and the same order on every rank."""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import subprocess
import sys

import pytest
import torch
from test_zero_pass import calls, plan
from torch import fx

from ptc.compiler.graph.meta import graph_record
from ptc.compiler.records.overlap import GRAD_BYTES, IN_FLIGHT
from ptc.compiler.cost.buckets import link_bucket_bytes, plan_buckets, resolve_bucket_bytes
from ptc.lower.driver import apply_pass, capture_plan, compile_plan
from ptc.compiler.graph.params import param_layout
from ptc.models import build_model
from ptc.passes import overlap_collectives_pass, shard_params_pass
from ptc.plan import LinkSpec
from ptc.ops.collectives import gather_params, gather_params_start

pytestmark = pytest.mark.timeout(120)


def with_parallel(p, **changes):
    return dataclasses.replace(p, parallel=dataclasses.replace(p.parallel, **changes))


def zero3_graph(p) -> fx.GraphModule:
    return apply_pass(shard_params_pass, capture_plan(p), p)


def gathered_units(gm: fx.GraphModule) -> list[tuple[int, ...]]:
    """Units each gather start reads, in graph order."""
    return [tuple(int(str(s.target).rsplit("_", 1)[1]) for s in start.args[0])
            for start in calls(gm, gather_params_start)]


class TestBuckets:
    def test_consecutive_items_fill_a_bucket_and_large_ones_stay_alone(self):
        assert plan_buckets([10, 10, 10, 50, 5, 5], 30) == [[0, 1, 2], [3], [4, 5]]
        assert plan_buckets([40, 1, 1], 30) == [[0], [1, 2]]
        assert plan_buckets([], 30) == []

    def test_items_sharing_a_unit_never_share_a_bucket(self):
        # A tied weight gathered by the embedding and again by the head.
        assert plan_buckets([1, 1, 1], 100, [[0], [1], [0]]) == [[0, 1], [2]]

    def test_auto_size_keeps_latency_a_tenth_of_the_transfer(self):
        link = LinkSpec(bandwidth=50e9, latency=5e-6)
        size = link_bucket_bytes(link)
        assert size == pytest.approx(9 * 5e-6 * 50e9, rel=1e-9)
        seconds = link.latency + size / link.bandwidth
        assert link.latency / seconds == pytest.approx(0.1, rel=1e-6)

    def test_auto_size_is_capped_by_the_largest_item_and_the_plan_overrides_it(self):
        p = plan("gpt")  # cpu preset: 20 us, 5 GB/s -> 900 kB, far above this model's layers
        assert resolve_bucket_bytes(p, [100, 3000, 200]) == 3000
        assert resolve_bucket_bytes(with_parallel(p, bucket_size=512.0), [100, 3000]) == 512

    @pytest.mark.parametrize("zero", [0, 1, 2])
    def test_gradient_buckets_take_the_link_size_whatever_the_items(self, zero):
        p = plan("gpt", zero=zero)  # resident gradients: no memory reason to cap the bucket
        assert resolve_bucket_bytes(p, [100, 3000, 200]) == link_bucket_bytes(p.hardware.intra)

    def test_dp_across_nodes_uses_the_inter_node_link(self):
        p = plan("gpt", dp=4)
        spread = dataclasses.replace(p, hardware=dataclasses.replace(
            p.hardware, nodes=2, gpus_per_node=2))
        big = [10**9]
        assert resolve_bucket_bytes(p, big) == link_bucket_bytes(p.hardware.intra)
        assert resolve_bucket_bytes(spread, big) == link_bucket_bytes(p.hardware.inter)


class TestZero3Scheduling:
    def test_prefetch_starts_each_gather_right_after_the_previous_wait(self):
        p = with_parallel(plan("gpt"), bucket_size=1.0)  # no merging: one gather per group
        gm = apply_pass(overlap_collectives_pass, zero3_graph(p), p)
        order = list(gm.graph.nodes)
        waits, starts = calls(gm, gather_params), calls(gm, gather_params_start)
        assert len(starts) == 6
        for wait, nxt in zip(waits, starts[1:]):
            between = order[order.index(wait) + 1:order.index(nxt)]
            assert all(n.op == "get_attr" for n in between), between
        assert graph_record(gm).overlap.prefetch == 1 and graph_record(gm).overlap.in_flight == IN_FLIGHT

    def test_waits_stay_right_before_the_first_use_of_their_weights(self):
        p = plan("llama")
        gm = apply_pass(overlap_collectives_pass, zero3_graph(p), p)
        for wait in calls(gm, gather_params):
            views, frontier = set(), [wait]
            while frontier:  # the weight views taken from the gathered buffers
                node = frontier.pop()
                views.add(node)
                frontier += [u for u in node.users
                             if u.target is operator.getitem or u.op == "call_method"]
            node = wait.next  # skip the views and the next gather's (prefetched) start
            while node in views or node.op == "get_attr" or node.target is gather_params_start:
                node = node.next
            assert views & set(node.all_input_nodes), f"{node} runs between {wait} and its use"

    def test_without_overlap_nothing_moves_and_nothing_stays_in_flight(self):
        p = with_parallel(plan("gpt", overlap=False), bucket_size=1.0)
        gm = apply_pass(overlap_collectives_pass, zero3_graph(p), p)
        for start in calls(gm, gather_params_start):
            assert start.next.target is gather_params and start.next.args[0] is start
        decided = graph_record(gm).overlap
        assert (decided.prefetch, decided.in_flight, decided.overlap) == (0, 0, False)

    def test_small_gathers_merge_up_to_the_bucket_size_in_order(self):
        p = plan("gpt", layers=3)
        gm = zero3_graph(p)
        before = gathered_units(gm)
        layout = gm.zero.layout
        sizes = [sum(GRAD_BYTES * layout.units[u].padded_numel for u in us) for us in before]
        bucket = sizes[2] + sizes[3]  # exactly two layers
        p = with_parallel(p, bucket_size=float(bucket))
        gm = apply_pass(overlap_collectives_pass, gm, p)
        after = gathered_units(gm)
        expected = [[u for i in group for u in before[i]]
                    for group in plan_buckets(sizes, bucket, before)]
        assert after == [tuple(g) for g in expected]
        assert len(after) < len(before)
        # The units gathered over dp keep their order: the guarantee every rank relies on.
        assert [u for us in after for u in us] == [u for us in before for u in us]
        decided = graph_record(gm).overlap
        assert decided.buckets == tuple(after) and decided.bucket_bytes == bucket

    def test_merged_gathers_compute_the_same_loss_and_gradients(self):
        p = plan("llama", dp=1)
        torch.manual_seed(0)
        tokens, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))

        def run(bucket: float):
            q = with_parallel(p, bucket_size=bucket)
            model = build_model(q.model, device="cpu", seed=1)
            gm = capture_plan(q, model)
            layout = param_layout(gm, 1)
            state, buffers = dict(model.named_parameters()), dict(model.named_buffers())
            gm = apply_pass(overlap_collectives_pass, apply_pass(shard_params_pass, gm, q), q)
            for i, unit in enumerate(layout.units):
                flat = torch.cat([state[n].detach().reshape(-1) for n in unit.params])
                gm.zero.register_parameter(f"shard_{i}", torch.nn.Parameter(flat))
            for name, value in buffers.items():
                owner, _, leaf = name.rpartition(".")
                module = gm.get_submodule(owner) if owner else gm
                if hasattr(module, leaf):
                    module._buffers[leaf] = value
            loss = gm(tokens, targets)
            loss.backward()
            return loss.detach(), [s.grad.clone() for s in gm.zero.parameters()], gm

        loss1, grads1, gm1 = run(1.0)
        loss2, grads2, gm2 = run(1e9)
        assert len(calls(gm2, gather_params)) < len(calls(gm1, gather_params))
        torch.testing.assert_close(loss2, loss1, rtol=0, atol=0)
        for a, b in zip(grads1, grads2):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


class TestGradientBuckets:
    @pytest.mark.parametrize("zero", [0, 1, 2])
    def test_units_are_bucketed_for_the_runtime(self, zero):
        p = plan("gpt", zero=zero, layers=3)
        gm = capture_plan(p)
        layout = param_layout(gm, p.parallel.dp)
        sizes = [GRAD_BYTES * u.padded_numel for u in layout.units]
        gm = apply_pass(overlap_collectives_pass, gm, p)
        decided = graph_record(gm).overlap
        expected = plan_buckets(sizes, resolve_bucket_bytes(p, sizes))
        assert decided.buckets == tuple(tuple(b) for b in expected)
        assert sorted(u for b in decided.buckets for u in b) == list(range(len(layout.units)))
        assert decided.bucket_bytes_each == tuple(sum(sizes[u] for u in b) for b in expected)

    def test_the_program_carries_each_stage_s_decisions(self):
        p = plan("gpt")
        program = compile_plan(p)
        assert program.stages[0].overlap is graph_record(program.stages[0].graph).overlap
        assert any(m.startswith("overlap_collectives_pass:") for m in program.pass_log)


SIGNATURE = """
import json, sys
from ptc.dsl import load_plan
from ptc.lower.driver import compile_plan
from ptc.ops.collectives import gather_params_start
program = compile_plan(load_plan(sys.argv[1]))
out = []
for stage in program.stages:
    order = [str(n.target) if n.op != "call_function" else n.target.__name__
             for n in stage.graph.graph.nodes
             if n.op == "call_function" and hasattr(n.target, "ptc_collective")]
    starts = [[str(s.target) for s in n.args[0]] for n in stage.graph.graph.nodes
              if n.target is gather_params_start]
    out.append({"collectives": order, "gathers": starts,
                "buckets": [list(b) for b in stage.overlap.buckets]})
print(json.dumps(out))
"""

PLAN = """
model llama { layers = 4; hidden = 32; heads = 4; kv_heads = 2; ffn = 64; vocab = 64; max_seq = 16 }
hardware { gpu = cpu; gpus_per_node = 8 }
parallel { tp = 2; pp = 2; dp = 2; zero = 3; sequence_parallel = true }
train { seq_len = 16; global_batch = 8; micro_batch = 2; dtype = fp32 }
"""


def test_every_rank_compiles_the_same_collective_order(tmp_path):
    """Ranks are separate processes: hash seeds and rank numbers must not change any decision."""
    plan_file = tmp_path / "p.ptc"
    plan_file.write_text(PLAN)
    outputs = []
    for seed, rank in (("0", "0"), ("12345", "5")):
        env = dict(os.environ, PYTHONHASHSEED=seed, RANK=rank, LOCAL_RANK=rank)
        done = subprocess.run([sys.executable, "-c", SIGNATURE, str(plan_file)], env=env,
                              capture_output=True, text=True, timeout=300, check=True)
        outputs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert outputs[0] == outputs[1]
    assert all(stage["collectives"] and stage["gathers"] for stage in outputs[0])
