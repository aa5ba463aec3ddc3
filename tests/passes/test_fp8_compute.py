"""The fp8_compute pass (quantize_gemms_pass): which linears and experts' grouped products
it rewrites, and with what."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests" / "distributed"):  # plain `pytest` puts neither on the path
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from hf_helpers import HFCase, hf_module, hf_plan  # noqa: E402

from ptc.compiler.graph.meta import get_info  # noqa: E402
from ptc.errors import CompileError  # noqa: E402
from ptc.lower.driver import compile_plan  # noqa: E402
from ptc.ops.expert_parallel import ep_dispatch  # noqa: E402
from ptc.ops.fp8_grouped import fp8_grouped_mm  # noqa: E402
from ptc.ops.fp8_linear import Fp8Scaling, fp8_linear  # noqa: E402
from ptc.ops.recompute import checkpoint_region  # noqa: E402
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec  # noqa: E402

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


# ---------------------------------------------------------------- routed experts


def _moe(recipe: str = "tensorwise", *, config: tuple = (), seq: int | None = None,
         **parallel):
    """The tiny Mixtral (4 experts, top-2) in fp8 (emulated) at `parallel`, compiled."""
    case = HFCase("mixtral", config=config)
    plan = hf_plan(case)
    world = parallel.get("tp", 1) * parallel.get("dp", 1)
    train = dataclasses.replace(plan.train, dtype="fp8", fp8_emulate=True, fp8_recipe=recipe,
                                fp8_scaling="delayed" if recipe == "tensorwise" else "current",
                                global_batch=2 * parallel.get("dp", 1))
    model = plan.model
    if seq is not None:
        train = dataclasses.replace(train, seq_len=seq)
        model = dataclasses.replace(model, max_seq=seq)
    plan = dataclasses.replace(plan, model=model, train=train,
                               hardware=HardwareSpec.preset("cpu", gpus_per_node=world),
                               parallel=dataclasses.replace(plan.parallel, **parallel))
    return compile_plan(plan, model=hf_module(case))


def _grouped(gm):
    return [n for n in gm.graph.nodes if n.target is fp8_grouped_mm]


def test_the_experts_grouped_products_become_fp8_grouped_mm_of_the_local_experts():
    """Under ep 2 each reads the dispatched rows and local offsets and the rank's 2 of the 4
    experts, with a state of a history row per expert of the whole stack. The routers stay
    in the compute dtype (their scores pick the experts), as Megatron-Core keeps them."""
    program = _moe(dp=2, ep=2)
    gm = program.stages[0].graph
    nodes = _grouped(gm)
    assert len(nodes) == 4 and len(_fp8_nodes(gm)) == 8  # q, k, v and o, in each layer
    for node in nodes:
        x, weight, offs, state = node.args
        assert offs.args[0].target is ep_dispatch and offs.args[1] == 1  # the local offsets
        if "gate_up" in str(state.target):
            assert x.args[0].target is ep_dispatch and x.args[1] == 0  # the dispatched rows
        assert get_info(weight).shapes[0][0] == 2
        scaling = gm.get_submodule(str(state.target))
        assert scaling.experts == 4 and scaling.expert_axis == "ep" and scaling.delayed
        assert get_info(node).kind == "linear" and get_info(node).flops > 0
    assert any("and 4 fp8_grouped_mm" in line for line in program.pass_log)


def test_tp_splits_the_expert_stacks_as_linears_and_says_so():
    """rowwise: gate_up column-parallel, down row-parallel (the scale vectors they reduce)."""
    gm = _moe("rowwise", tp=2).stages[0].graph
    roles = {str(n.args[3].target).rsplit("experts_", 1)[1]:
             gm.get_submodule(str(n.args[3].target)).role for n in _grouped(gm)}
    assert roles == {"gate_up_proj": "column", "down_proj": "row"}, roles


def test_checkpointed_and_zero3_experts_take_their_state_and_gathered_stacks():
    gm = _moe(dp=2, ep=2, zero=3, checkpoint="full").stages[0].graph
    regions = [gm.get_submodule(str(n.args[0].target)) for n in gm.graph.nodes
               if n.target is checkpoint_region]
    inner = [n for r in regions for n in _grouped(r)]
    assert len(inner) == 4 and all(n.args[3].op == "placeholder" for n in inner)
    assert all(n.args[1].op != "get_attr" for n in inner)


def test_mxfp8_refuses_an_expert_stack_without_whole_blocks_naming_it():
    """Every linear holds whole blocks (4 key/value heads, 32 experts for the router), the
    experts' down stack contracts 48 features."""
    config = (("num_key_value_heads", 4), ("num_local_experts", 32),
              ("intermediate_size", 48), ("max_position_embeddings", 32))
    with pytest.raises(CompileError, match=r"fp8_recipe = mxfp8: grouped product node "
                                           r"_grouped_mm_1 .*of expert stack "
                                           r"model\.layers\.0\.mlp\.experts\.down_proj has 48 "
                                           r"input and 32 output features on each rank"):
        _moe("mxfp8", config=config, seq=32)
