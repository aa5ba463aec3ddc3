"""The activation_checkpoint pass (checkpoint_layers_pass): numerics, memory, "auto", pipelines."""

from __future__ import annotations

import copy
import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import fx, nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from ptc.compiler.capture import with_weights  # noqa: E402
from ptc.compiler.search.estimate import estimate  # noqa: E402
from ptc.compiler.records.layout import Layout  # noqa: E402
from ptc.compiler.memory.model import precision, stage_memory  # noqa: E402
from ptc.lower.driver import apply_pass, capture_plan, compile_graph, lower_graph, pass_list  # noqa: E402
from ptc.compiler.profile.types import DTYPES  # noqa: E402
from ptc.compiler.profile.cache import model_profile  # noqa: E402
from ptc.compiler.graph.params import param_layout  # noqa: E402
from ptc.models import build_model  # noqa: E402
from ptc.compiler.graph.stage_graphs import pipeline_stages, stage_info  # noqa: E402
from ptc.passes import (checkpoint_layers_pass, quantize_gemms_pass,  # noqa: E402
                        shard_params_pass, split_pipeline_pass)
from ptc.lower.resolve import resolve  # noqa: E402
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec  # noqa: E402
from ptc.ops.recompute import checkpoint_region  # noqa: E402
from ptc.units import format_bytes  # noqa: E402
from tests.memory.measure import buffers_as_built, cached_by_regions  # noqa: E402
from tests.memory.test_measured_activations import cpu_statistics_gap  # noqa: E402
from tests.tolerances import assert_loss_and_grads_match  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SPECS = {
    "gpt": ModelSpec(family="gpt", layers=3, hidden=96, heads=4, vocab=256, max_seq=64),
    "llama": ModelSpec(family="llama", layers=3, hidden=96, heads=6, kv_heads=2, ffn=256,
                       vocab=256, max_seq=64),
}
POLICIES = ["none", "full", "selective", ("full", "selective", "none")]
NEW_POLICIES = ["ops", "modules(mlp)", "modules(norm)", "modules(act)",
                "modules(core_attn, mlp, norm, act)", ("ops", "modules(norm, act)", "none")]
"""Op-level and module recompute (`ptc.compiler.graph.recompute_regions`)."""
REGIONS = {"none": 0, "full": 1, "selective": 1, "ops": 1, "modules(mlp)": 1,
           "modules(norm)": 2, "modules(act)": 1, "modules(core_attn, mlp, norm, act)": 3,
           "modules(norm, act)": 3}
"""Regions per layer of the tiny models: norm, act and mlp share the MLP's input linears."""
B, S = 2, 32


def plan(family: str, checkpoint, *, zero: int = 0, pp: int = 1, hbm: float | None = None,
         spec: ModelSpec | None = None, dtype: str = "fp32", recipe: str = "tensorwise") -> Plan:
    """A plan of the tiny model on CPU processes; fp16 at the CPU's fp32 rate (the preset
    names none for it; memory does not depend on it), fp8 emulated (`recipe`: its
    fp8_recipe, with current scaling but for tensorwise)."""
    hw = HardwareSpec.preset("cpu", gpus_per_node=pp)
    if hbm is not None:
        hw = dataclasses.replace(hw, hbm_bytes=hbm)
    if dtype == "fp16":
        hw = dataclasses.replace(hw, peak_flops={**hw.peak_flops, "fp16": hw.peak_flops["fp32"]})
    return Plan(model=spec or SPECS[family], hardware=hw,
                parallel=ParallelSpec(pp=pp, zero=zero, checkpoint=checkpoint),
                train=TrainSpec(seq_len=S, global_batch=B * pp, micro_batch=B, dtype=dtype,
                                fp8_emulate=dtype == "fp8", fp8_recipe=recipe,
                                fp8_scaling="delayed" if recipe == "tensorwise" else "current"))


def dtype_passes(dtype: str, *passes) -> tuple:
    """`passes`, after fp8_compute in an fp8 plan, as the compile pipeline runs them."""
    return (quantize_gemms_pass, *passes) if dtype == "fp8" else passes


def kept_layer_norms(gm: fx.GraphModule) -> int:
    """LayerNorms of `gm` outside its recompute regions (those inside run without saving):
    the ones whose statistics backward keeps (`cpu_statistics_gap`)."""
    return sum(isinstance(gm.get_submodule(str(n.target)), nn.LayerNorm)
               for n in gm.graph.nodes if n.op == "call_module")


def regions(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is checkpoint_region]


def loss_and_grads(gm, model, tokens, targets):
    loss = gm(tokens, targets)
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def exact_loss_and_grads(p: Plan, model, tokens, targets):
    """The uncheckpointed graph in float64 from the same weights: the tolerances' exact result."""
    model64 = copy.deepcopy(model).double()
    return loss_and_grads(with_weights(capture_plan(p), model64), model64, tokens, targets)


def measured_saved_bytes(gm: fx.GraphModule, tokens, targets) -> int:
    """Distinct non-parameter storages autograd saves (the inputs each region keeps among
    them), plus what the saving regions cache."""
    state = {t.untyped_storage().data_ptr() for t in (*gm.parameters(), *gm.buffers())}
    saved: dict[int, int] = {}

    def note(t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in state:
            saved[ptr] = t.untyped_storage().nbytes()

    def pack(t):
        note(t)
        return t

    # torch's checkpoint saves a region's inputs through these hooks too.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cached_by_regions(note):
        loss = gm(tokens, targets)
    loss.backward()
    return sum(saved.values())


@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("policy", POLICIES + NEW_POLICIES, ids=str)
def test_loss_and_gradients_match_the_uncheckpointed_graph(family, policy):
    p = plan(family, policy)
    model = build_model(p.model, device="cpu", seed=1)
    tokens, targets = torch.randint(0, p.model.vocab, (2, B, S))
    ref = loss_and_grads(with_weights(capture_plan(p), model), model, tokens, targets)
    gm = apply_pass(checkpoint_layers_pass, with_weights(capture_plan(p), model), p)
    per_layer = [policy] * 3 if isinstance(policy, str) else policy
    assert len(regions(gm)) == sum(REGIONS[pol] for pol in per_layer)
    got = loss_and_grads(gm, model, tokens, targets)
    assert_loss_and_grads_match(got, ref, exact_loss_and_grads(p, model, tokens, targets),
                                f"{family} {policy}", tokens.numel())


@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("policy", ["full", "selective", "ops", "modules(mlp)", "modules(norm)",
                                    "modules(core_attn, mlp, norm, act)"])
def test_fp8_recompute_gives_the_uncheckpointed_fp8_graph_bit_for_bit(family, policy):
    """train.dtype = fp8 (emulated): a layer's float8 linears are linears to the regions (a
    saving one keeps their GEMMs' outputs), and a recomputed forward quantises as the first
    did, so loss and gradients are those of the graph without recompute, exactly."""
    p = plan(family, policy, dtype="fp8")
    model = build_model(p.model, device="cpu", seed=1).to(torch.bfloat16)
    tokens, targets = torch.randint(0, p.model.vocab, (2, B, S))

    def run(passes):
        gm = lower_graph(with_weights(capture_plan(p), model), p, pass_list(*passes))[1].graph
        return len(regions(gm)), loss_and_grads(gm, model, tokens, targets)

    _, (ref_loss, ref_grads) = run(dtype_passes("fp8"))
    count, (loss, grads) = run(dtype_passes("fp8", checkpoint_layers_pass))
    assert count == 3 * REGIONS[policy]
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["full", "selective", "ops", "modules(mlp)",
                                    "modules(core_attn, mlp, norm, act)"])
def test_dropout_masks_match_on_recompute(policy):
    spec = dataclasses.replace(SPECS["gpt"], dropout=0.2)
    p = plan("gpt", policy, spec=spec)
    model = build_model(spec, device="cpu", seed=1)
    tokens, targets = torch.randint(0, spec.vocab, (2, B, S))
    torch.manual_seed(5)
    ref = loss_and_grads(with_weights(capture_plan(p), model), model, tokens, targets)
    gm = apply_pass(checkpoint_layers_pass, with_weights(capture_plan(p), model), p)
    # selective: attention's region found past nn.Dropout calls
    assert len(regions(gm)) == 3 * REGIONS[policy]
    torch.manual_seed(5)
    got = loss_and_grads(gm, model, tokens, targets)
    torch.manual_seed(5)  # float64 draws the same masks
    assert_loss_and_grads_match(got, ref, exact_loss_and_grads(p, model, tokens, targets),
                                f"{policy}, dropout 0.2", tokens.numel())


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "fp8"])
@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("policy", POLICIES + NEW_POLICIES, ids=str)
def test_saved_bytes_match_the_memory_model(family, policy, dtype):
    """Exact, in every dtype: a fully recomputed layer keeps its input in the compute dtype
    whether or not a node after it saves that storage (bf16 RMSNorm saves an fp32 copy).
    In fp8 each float8 linear outside a region keeps its input's float8 copy and two
    scales; one a region recomputes keeps nothing; one a saving region keeps (`ops`,
    `modules(norm)`) keeps its output, bias added, in bf16, as a bf16 linear."""
    _check_saved_bytes(family, policy, dtype)


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("policy", POLICIES + NEW_POLICIES, ids=str)
def test_fp8_recipes_saved_bytes_match_the_memory_model(family, policy, recipe):
    """Exact under every fp8 recipe: a float8 linear outside a region keeps its input's
    column-quantised copy and its scales, rowwise one fp32 per input feature, mxfp8 one
    E8M0 byte per 32 elements (`profile.fp8`)."""
    _check_saved_bytes(family, policy, "fp8", recipe)


def _check_saved_bytes(family, policy, dtype, recipe="tensorwise"):
    """What the lowered one-process graph saves equals the memory model's activations."""
    p = plan(family, policy, dtype=dtype, recipe=recipe)
    model = build_model(p.model, device="cpu", seed=0).to(DTYPES[dtype])
    tokens, targets = torch.randint(0, p.model.vocab, (2, B, S))
    gm = lower_graph(with_weights(capture_plan(p), model), p,
               pass_list(*dtype_passes(dtype, checkpoint_layers_pass)))[1].graph
    measured = measured_saved_bytes(buffers_as_built(gm), tokens, targets)
    layout = Layout(tp=1, pp=1, dp=1, vstages=1, micro_batch=B, microbatches=1, zero=0, sp=False,
                    schedule="1f1b", layers=p.model.layers, checkpoint=policy, overlap=True)
    prec = precision(DTYPES[dtype].itemsize, "adamw")
    predicted = stage_memory(model_profile(p.model, dtype, fp8_recipe=recipe), layout, prec,
                             S)[0]
    gap = cpu_statistics_gap(kept_layer_norms(gm), B * S, DTYPES[dtype])
    assert predicted["activations"] == measured + gap


def measured_bytes_per_stage(pipeline: fx.GraphModule, tokens, targets) -> list[int]:
    """Per pipeline stage, one micro-batch: what autograd saves, the regions' inputs, the outputs.

    Counted per stage as `measured_saved_bytes` counts a whole graph (a
    storage two stages both keep counts in each: on two ranks it is two
    copies). The runtime keeps a stage's inputs and outputs until the
    micro-batch's backward (`ptc.runtime.executor`): a later stage's inputs
    and an earlier stage's outputs count too (the first stage's inputs are
    the tokens, its graph's own).
    """
    stages = pipeline_stages(pipeline)
    state = {t.untyped_storage().data_ptr() for t in (*pipeline.parameters(), *pipeline.buffers())}
    saved: list[dict[int, int]] = [{} for _ in stages]
    current = [0]

    def note(t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in state:
            saved[current[0]][ptr] = t.untyped_storage().nbytes()

    def pack(t):
        note(t)
        return t

    def enter(index):
        return lambda _m, _args: current.__setitem__(0, index)

    hooks = []
    for index, (_, stage) in enumerate(stages):
        hooks.append(stage.register_forward_pre_hook(enter(index)))
        if index > 0:
            hooks.append(stage.register_forward_pre_hook(
                lambda _m, args: [note(a) for a in args if isinstance(a, torch.Tensor)
                                    and a.is_floating_point()] and None))
        if index < len(stages) - 1:
            hooks.append(stage.register_forward_hook(
                lambda _m, _args, out: [note(t) for t in out] and None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cached_by_regions(note):
        loss = pipeline(tokens, targets)
    for h in hooks:
        h.remove()
    loss.backward()
    return [sum(stage.values()) for stage in saved]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("policy", ["none", "selective", "full", ("none", "full", "full", "none"),
                                    ("full", "selective", "selective", "full"), "ops",
                                    "modules(norm, act)", ("modules(mlp)", "ops", "ops", "full"),
                                    ("none", "ops", "modules(norm)", "none")], ids=str)
def test_saved_bytes_per_pipeline_stage_match_the_memory_model(family, policy, dtype):
    """pp = 2, one micro-batch in flight: each stage exactly as the model predicts.

    The model charges a stage's activations term with what its layers keep
    (the stage's output included, which the runtime holds until backward),
    and a stage after the first with a receive buffer of one boundary
    activation (buffers term): with one micro-batch in flight that buffer is
    the input the stage keeps, so it is part of the prediction here.
    """
    spec = dataclasses.replace(SPECS[family], layers=4)
    p = plan(family, policy, pp=2, spec=spec, dtype=dtype)
    model = build_model(spec, device="cpu", seed=0).to(DTYPES[dtype])
    pipeline = lower_graph(with_weights(capture_plan(p), model), p, pass_list(
        *dtype_passes(dtype, split_pipeline_pass, checkpoint_layers_pass)))[1].graph
    stages = [stage_info(s) for _, s in pipeline_stages(pipeline)]
    assert [a for a in stages[0].atoms if a.startswith("layers.")] == ["layers.0", "layers.1"]
    # Apart, as the runtime reads them: one storage would count whole on both stages.
    tokens, targets = (t.clone() for t in torch.randint(0, spec.vocab, (2, B, S)))
    measured = measured_bytes_per_stage(buffers_as_built(pipeline), tokens, targets)
    profile = model_profile(spec, dtype)
    layout = Layout(tp=1, pp=2, dp=1, vstages=1, micro_batch=B, microbatches=1, zero=0,
                    sp=False, schedule="1f1b", layers=4, checkpoint=policy, overlap=True)
    width = DTYPES[dtype].itemsize
    predicted = [terms["activations"] for terms in stage_memory(profile, layout,
                                                                precision(width, "adamw"), S)]
    predicted[1] += width * profile.fn["boundary"](B, S)  # the received input
    for stage, (_, graph) in enumerate(pipeline_stages(pipeline)):
        gap = cpu_statistics_gap(kept_layer_norms(graph), B * S, DTYPES[dtype])
        assert measured[stage] + gap == predicted[stage], f"stage {stage}"


def test_pass_logs_and_leaves_none_alone(caplog):
    p = plan("gpt", ("full", "selective", "full"))
    with caplog.at_level("INFO", logger="ptc.passes"):
        apply_pass(checkpoint_layers_pass, capture_plan(p), p)
    assert "checkpointed 2 layers full, 1 selective" in caplog.text
    gm = capture_plan(plan("gpt", "none"))
    code = gm.code
    assert apply_pass(checkpoint_layers_pass, gm, plan("gpt", "none")) is gm and gm.code == code


def _hbm_for(family: str, policy: tuple[str, ...]) -> float:
    return estimate(plan(family, policy)).peak_memory_bytes


@pytest.mark.parametrize("k", [0, 2, 3])
def test_auto_picks_k_full_layers_under_a_budget_that_forces_k(k):
    """k = 1 cannot be forced here: one full layer of three saves less than its recompute set."""
    family = "llama"  # its fused attention core saves little: selective cannot replace a full layer
    forced = ("full",) * k + ("none",) * (3 - k)
    p = plan(family, "auto", hbm=_hbm_for(family, forced))
    first, second = (list(resolve(capture_plan(p), p).checkpoint) for _ in range(2))
    assert first == second
    assert first.count("full") == k and first.count("selective") == 0
    gm = apply_pass(checkpoint_layers_pass, capture_plan(p), p)
    assert len(regions(gm)) == k


def test_zero3_after_checkpoint_keeps_loss_and_gradients():
    p = plan("llama", "full", zero=3)
    model = build_model(p.model, device="cpu", seed=1)
    tokens, targets = torch.randint(0, p.model.vocab, (2, B, S))
    layout = param_layout(capture_plan(p, model), 1)
    state = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    results = []
    for passes in ((shard_params_pass,), (checkpoint_layers_pass, shard_params_pass)):
        gm = capture_plan(p, model)
        for fn in passes:
            gm = apply_pass(fn, gm, p)
        for i, unit in enumerate(layout.units):
            flat = torch.cat([state[n].detach().reshape(-1) for n in unit.params])
            gm.zero.register_parameter(f"shard_{i}", nn.Parameter(flat))
        for name, value in buffers.items():
            owner, _, leaf = name.rpartition(".")
            if hasattr(gm.get_submodule(owner) if owner else gm, leaf):
                (gm.get_submodule(owner) if owner else gm)._buffers[leaf] = value
        loss = gm(tokens, targets)
        loss.backward()
        results.append((loss, [s.grad for s in gm.zero.parameters()], gm))
    assert len(regions(results[1][2])) == 3
    loss, grads = exact_loss_and_grads(p, model, tokens, targets)
    grads = dict(zip(state, grads))
    shards = [torch.cat([grads[n].reshape(-1) for n in unit.params]) for unit in layout.units]
    assert_loss_and_grads_match(results[1][:2], results[0][:2], (loss, shards),
                                "ZeRO-3 with and without checkpoints", tokens.numel())


def test_runs_per_pipeline_stage():
    spec = dataclasses.replace(SPECS["gpt"], layers=4)
    p = plan("gpt", ("full", "selective", "none", "full"), pp=2, spec=spec)
    program = compile_graph(capture_plan(p), p)
    assert any(m.startswith("checkpoint_layers_pass") for m in program.pass_log)
    per_stage = [sorted(n.args[0].target for n in regions(s.graph)) for s in program.stages]
    assert per_stage == [["ckpt_region_0_full_0", "ckpt_region_1_selective_0"],
                         ["ckpt_region_3_full_0"]]


def test_explain_lists_the_policy_of_every_layer_per_stage():
    from rich.console import Console  # noqa: PLC0415

    from ptc.views.explain import render_explain  # noqa: PLC0415

    spec = dataclasses.replace(SPECS["llama"], layers=4)
    console = Console(width=160, record=True)
    console.print(render_explain(plan("llama", ("full", "selective", "none", "full"), pp=2,
                                      spec=spec)))
    text = console.export_text()
    assert "Activation checkpointing (checkpoint = per layer" in text
    assert "0:full, 1:selective" in text and "2:none, 3:full" in text
    assert "Activation checkpointing" not in _explain_text(plan("llama", "none"))


def test_explain_states_the_auto_choice_per_stage_against_the_budget():
    """auto under a margin: the title states budget = HBM less margin; each stage its choice."""
    spec = dataclasses.replace(SPECS["gpt"], layers=4)
    loose = plan("gpt", "none", pp=2, spec=spec)
    # Stage 0 (two micro-batches in flight) must give up its uncheckpointed peak; stage 1 fits.
    budget = estimate(loose).stage_memory_bytes[0] - 1
    hw = dataclasses.replace(loose.hardware, memory_margin=loose.hardware.hbm_bytes - budget)
    p = dataclasses.replace(plan("gpt", "auto", pp=2, spec=spec), hardware=hw)
    est = estimate(p)
    text = _explain_text(p)
    assert (f"budget {format_bytes(budget)} per GPU = HBM {format_bytes(hw.hbm_bytes)} less "
            f"margin {format_bytes(hw.memory_margin)}") in " ".join(text.split())
    chosen = est.layout.checkpoint
    assert chosen[2:] == ("none", "none") and chosen[:2] != ("none", "none")
    rows = [line for line in text.splitlines()  # the checkpointing table's stage rows
            if re.match(r"│\s*[01]\s*│", line) and ("│ 0" in line or "│ 2-3:none" in line)]
    assert len(rows) == 2
    # Consecutive layers of one policy print as one run.
    assert (f"0-1:{chosen[0]}" if chosen[0] == chosen[1]
            else f"0:{chosen[0]}, 1:{chosen[1]}") in rows[0]
    assert f"{format_bytes(budget - est.stage_memory_bytes[0])} free" in rows[0]
    assert f"{format_bytes(budget - est.stage_memory_bytes[1])} free" in rows[1]


def _explain_text(p: Plan) -> str:
    from rich.console import Console  # noqa: PLC0415

    from ptc.views.explain import render_explain  # noqa: PLC0415

    console = Console(width=160, record=True)
    console.print(render_explain(p))
    return console.export_text()


@pytest.mark.parametrize("policy, module", [("modules(act)", "act"), ("modules(mlp)", "mlp"),
                                            ("modules(core_attn, norm)", "core_attn"),
                                            ("modules(norm)", "norm")])
def test_a_module_the_layer_lacks_is_one_compile_error_naming_layer_and_module(policy, module):
    """Never recompute nothing silently: two linears have no activation, MLP, attention or
    norm."""
    from ptc.compiler.graph.recompute_regions import recompute_regions  # noqa: PLC0415
    from ptc.errors import CompileError  # noqa: PLC0415

    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    nodes = [n for n in gm.graph.nodes if n.op == "call_module"]
    with pytest.raises(CompileError) as info:
        recompute_regions(nodes, policy, 3)
    message = str(info.value)
    assert "\n" not in message and "layer 3" in message and f"({module})" in message


def test_explain_names_op_level_and_module_policies():
    spec = dataclasses.replace(SPECS["llama"], layers=4)
    text = _explain_text(plan("llama", ("ops", "ops", "modules(core_attn, mlp)", "none"),
                              pp=2, spec=spec))
    assert "0-1:ops" in text and "2:modules(core_attn, mlp), 3:none" in " ".join(text.split())
