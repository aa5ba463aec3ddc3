"""The fp8_compute pass (quantize_gemms_pass): which linears it rewrites, and with what."""

from __future__ import annotations

import pytest

from ptc.compiler.graph.meta import get_info
from ptc.errors import CompileError
from ptc.lower.driver import compile_plan
from ptc.ops.fp8_linear import Fp8Scaling, fp8_linear
from ptc.ops.recompute import checkpoint_region
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec

pytestmark = pytest.mark.timeout(120)


def _plan(*, dtype="fp8", scaling="delayed", zero=0, checkpoint="none", dp=1) -> Plan:
    return Plan(model=ModelSpec(family="llama", layers=2, hidden=32, heads=4, kv_heads=2,
                                ffn=64, vocab=64, max_seq=16),
                hardware=HardwareSpec.preset("cpu", gpus_per_node=dp),
                parallel=ParallelSpec(dp=dp, zero=zero, checkpoint=checkpoint),
                train=TrainSpec(seq_len=16, global_batch=2 * dp, micro_batch=2, dtype=dtype,
                                fp8_scaling=scaling, fp8_amax_history=8, fp8_emulate=True))


def _fp8_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is fp8_linear]


def test_the_layers_linears_become_fp8_linear_and_the_head_stays():
    program = compile_plan(_plan())
    gm = program.stages[0].graph
    nodes = _fp8_nodes(gm)
    assert len(nodes) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert {get_info(n).layer for n in nodes} == {0, 1}
    assert all(get_info(n).kind == "linear" and get_info(n).flops > 0 for n in nodes)
    heads = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "head"
             or (n.op == "call_function" and n.name == "head")]
    assert heads and all(n.target is not fp8_linear for n in heads)
    scaling = gm.get_submodule(str(nodes[0].args[3].target))
    assert isinstance(scaling, Fp8Scaling) and scaling.delayed and scaling.window == 8
    assert scaling.axis == "tp" and scaling.emulate
    assert not list(gm.get_submodule("fp8").buffers())  # state, not model buffers
    assert any("inserted 14 fp8_linear" in line for line in program.pass_log)


def test_other_dtypes_are_left_alone():
    gm = compile_plan(_plan(dtype="bf16")).stages[0].graph
    assert not _fp8_nodes(gm)


def test_checkpointed_layers_are_handed_their_scaling_state():
    gm = compile_plan(_plan(checkpoint="full")).stages[0].graph
    regions = [gm.get_submodule(str(n.args[0].target)) for n in gm.graph.nodes
               if n.target is checkpoint_region]
    assert len(regions) == 2
    inner = [n for r in regions for n in _fp8_nodes(r)]
    assert len(inner) == 14 and all(n.args[3].op == "placeholder" for n in inner)


def test_zero3_rewrites_the_weight_fp8_linear_reads():
    gm = compile_plan(_plan(zero=3, dp=2)).stages[0].graph
    nodes = _fp8_nodes(gm)
    assert len(nodes) == 14
    assert all(n.args[1].op != "get_attr" for n in nodes)  # views of gathered shards


def _recipe_plan(recipe: str, *, tp: int = 1, sp: bool = False, hidden: int = 64,
                 seq: int = 32) -> Plan:
    return Plan(model=ModelSpec(family="llama", layers=1, hidden=hidden, heads=4, kv_heads=4,
                                ffn=2 * hidden, vocab=64, max_seq=seq),
                hardware=HardwareSpec.preset("cpu", gpus_per_node=tp),
                parallel=ParallelSpec(tp=tp, sequence_parallel=sp),
                train=TrainSpec(seq_len=seq, global_batch=1, micro_batch=1, dtype="fp8",
                                fp8_scaling="current", fp8_recipe=recipe, fp8_emulate=True))


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_each_linear_is_told_its_recipe_and_tp_role(recipe):
    gm = compile_plan(_recipe_plan(recipe, tp=2)).stages[0].graph
    roles = {}
    for node in _fp8_nodes(gm):
        scaling = gm.get_submodule(str(node.args[3].target))
        assert scaling.recipe == recipe and not scaling.delayed
        roles[get_info(node).module_path.rsplit(".", 1)[-1]] = scaling.role
    assert roles == {"q": "column", "k": "column", "v": "column", "gate": "column",
                     "up": "column", "o": "row", "down": "row"}, roles


def test_mxfp8_refuses_a_linear_without_whole_blocks_naming_it():
    with pytest.raises(CompileError, match=r"quantize_gemms_pass.*fp8_recipe = mxfp8: linear "
                                           r"layers\.0\.attn\.q has 32 input and 16 output "
                                           r"features on each rank"):
        compile_plan(_recipe_plan("mxfp8", tp=2, hidden=32))


def test_mxfp8_refuses_sequence_chunks_without_whole_blocks():
    with pytest.raises(CompileError, match=r"train\.seq_len: seq_len / \(cp · tp\) = 16 per "
                                           r"rank tokens, not a multiple of 32"):
        compile_plan(_recipe_plan("mxfp8", tp=2, sp=True))
    compile_plan(_recipe_plan("mxfp8", tp=2, sp=True, seq=64))
