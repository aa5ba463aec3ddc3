"""The pipeline_split pass (split_pipeline_pass) on small captured graphs.

Checks the cut (stage graphs, what crosses, tied weights), that the
pipeline graph computes the captured graph's loss and gradients, the cost
model's balancing, pinned cuts, the memory constraint, and the Program that
compile_plan builds from a split graph.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import fx, nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from ptc.compiler.capture import with_weights  # noqa: E402
from ptc.lower.driver import apply_pass, capture_plan, compile_plan  # noqa: E402
from ptc.compiler.graph.params import ZeroShards, param_layout  # noqa: E402
from ptc.compiler.graph.stage_graphs import (pipeline_info, pipeline_stages, stage_info)  # noqa: E402
from ptc.errors import CompileError, PlanError  # noqa: E402
from ptc.models import build_model  # noqa: E402
from ptc.passes import split_pipeline_pass  # noqa: E402
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec  # noqa: E402
from tests.tolerances import assert_loss_and_grads_match, assert_loss_within_rounding  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def model_spec(family: str = "gpt", *, layers: int = 4, vocab: int = 64) -> ModelSpec:
    if family == "gpt":
        return ModelSpec(family="gpt", layers=layers, hidden=32, heads=4, vocab=vocab, max_seq=16)
    if family == "llama":
        return ModelSpec(family="llama", layers=layers, hidden=32, heads=4, kv_heads=2, ffn=64,
                         vocab=vocab, max_seq=16)
    return ModelSpec(family="custom", factory="test_pipeline_split:LongSkip")


def make_plan(family: str = "gpt", *, pp: int = 2, v: int = 1, m: int = 4, zero: int = 0,
              layers: int = 4, vocab: int = 64, hbm: float | None = None,
              schedule: str | None = None) -> Plan:
    hardware = HardwareSpec.preset("cpu", gpus_per_node=pp)
    if hbm is not None:
        hardware = dataclasses.replace(hardware, hbm_bytes=hbm)
    return Plan(model=model_spec(family, layers=layers, vocab=vocab), hardware=hardware,
                parallel=ParallelSpec(pp=pp, zero=zero, virtual_stages=v,
                                      schedule=schedule or ("interleaved" if v > 1 else "1f1b")),
                train=TrainSpec(seq_len=16, global_batch=2 * m, micro_batch=2, dtype="fp32"))


def split(plan: Plan, knobs: dict | None = None, model: nn.Module | None = None):
    gm = capture_plan(plan, model)
    return gm, apply_pass(split_pipeline_pass, gm, plan, **(knobs or {}))


def bind(pipeline, model: nn.Module) -> None:
    """Give every stage graph copies of `model`'s weights and buffers, by name.

    As `with_weights` does, tensors an export-door graph creates on meta are made on the CPU.
    """
    named = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())

    def on_cpu(arg):
        return torch.device("cpu") if isinstance(arg, torch.device) and arg.type == "meta" else arg

    for _, stage in pipeline_stages(pipeline):
        for node in stage.graph.nodes:
            node.args = fx.node.map_aggregate(node.args, on_cpu)
            node.kwargs = fx.node.map_aggregate(node.kwargs, on_cpu)
        stage.recompile()
        for name, _ in list(stage.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            stage.get_submodule(owner)._parameters[leaf] = nn.Parameter(
                named[name].detach().clone())
        for name, _ in list(stage.named_buffers()):
            owner, _, leaf = name.rpartition(".")
            stage.get_submodule(owner)._buffers[leaf] = buffers[name].clone()


def exact(gm: fx.GraphModule, model: nn.Module) -> tuple[fx.GraphModule, nn.Module]:
    """The captured graph on a float64 copy of `model`: the tolerances' exact result."""
    model64 = copy.deepcopy(model).double()
    return with_weights(gm, model64), model64


class LongSkip(nn.Module):
    """Embedding, four residual blocks, and a head reading the last block plus the embedding.

    The embedding output is used by the last stage (a skip over the middle
    ones), and the head's reshape uses the batch shape read from the tokens.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        x0 = x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x + x0).view(b, s, -1)


class TestSplitPipelinePass:
    def test_pp1_leaves_the_graph_alone(self) -> None:
        plan = Plan(model=model_spec(), hardware=HardwareSpec.preset("cpu", gpus_per_node=1),
                    train=TrainSpec(seq_len=16, global_batch=2, micro_batch=2, dtype="fp32"))
        gm = capture_plan(plan)
        assert apply_pass(split_pipeline_pass, gm, plan) is gm

    def test_stages_and_what_crosses(self) -> None:
        _, pipeline = split(make_plan(pp=2))
        stages = [stage_info(s) for _, s in pipeline_stages(pipeline)]
        assert [s.index for s in stages] == [0, 1] and [s.rank for s in stages] == [0, 1]
        assert stages[0].data == ("tokens",) and stages[1].data == ("targets",)
        assert stages[0].atoms + stages[1].atoms == (
            "embed", "pos_embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head")
        (out,) = stages[0].outputs
        assert stages[1].inputs == (out,)
        assert out.shape == (2, 16, 32) and out.dtype == torch.float32 and out.requires_grad
        assert stages[1].outputs == () and stages[1].is_last
        code = pipeline.code
        assert "stage_0 = self.stage_0(tokens)" in code and "self.stage_1(getitem, targets)" in code

    def test_interleaved_places_chunks_round_robin(self) -> None:
        _, pipeline = split(make_plan(pp=2, v=2, layers=4))
        stages = [stage_info(s) for _, s in pipeline_stages(pipeline)]
        assert [(s.rank, s.chunk) for s in stages] == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert pipeline_info(pipeline).pp == 2 and pipeline_info(pipeline).virtual == 2

    def test_tied_embedding_is_held_by_first_and_last_stage(self) -> None:
        _, pipeline = split(make_plan(pp=4))
        stages = [stage_info(s) for _, s in pipeline_stages(pipeline)]
        assert stages[0].tied == (("embed.weight", "embed.weight"),)
        assert stages[3].tied == (("head.weight", "embed.weight"),)
        assert stages[1].tied == stages[2].tied == ()
        assert pipeline_info(pipeline).tied == (("embed.weight", (0, 3)),)
        first, last = (s for _, s in pipeline_stages(pipeline)[::3])
        assert first.get_parameter("embed.weight") is not last.get_parameter("head.weight")

    @pytest.mark.parametrize("family,pp,v,layers,ends", [
        ("gpt", 2, 1, 4, None), ("gpt", 4, 1, 4, None), ("llama", 2, 2, 4, None),
        ("gpt", 4, 2, 8, None),
        # The first stage the embedding alone, the last the head and the loss alone.
        ("gpt", 2, 2, 2, 1), ("llama", 2, 2, 2, 1)])
    def test_pipeline_graph_computes_the_captured_loss_and_gradients(
            self, family: str, pp: int, v: int, layers: int, ends: int | None) -> None:
        if ends is None:
            plan = make_plan(family, pp=pp, v=v, layers=layers, m=pp)
        else:
            plan = make_plan(family, pp=pp, v=v, layers=pp * v, m=pp)
            plan = dataclasses.replace(
                plan, model=model_spec(family, layers=layers), parallel=dataclasses.replace(
                    plan.parallel, first_stage_layers=ends, last_stage_layers=ends))
        gm, pipeline = split(plan)
        if ends is not None:
            atoms = [stage_info(s).atoms for _, s in pipeline_stages(pipeline)]
            assert not any(a.startswith("layers.") for a in atoms[0] + atoms[-1]), atoms
        model = build_model(plan.model, device="cpu", seed=1)
        bind(pipeline, model)
        tokens, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
        expected = with_weights(gm, model)(tokens, targets)
        got = pipeline(tokens, targets)
        graph64, model64 = exact(gm, model)
        exact_loss = graph64(tokens, targets)
        for loss in (expected, got, exact_loss):
            loss.backward()
        grads: dict[str, torch.Tensor] = {}
        for _, stage in pipeline_stages(pipeline):
            for name, p in stage.named_parameters():
                grads[name] = grads.get(name, 0) + p.grad
        summed = {name: sum(g for n, g in grads.items() if n == name or (
            model.tied and name == "embed.weight" and n == "head.weight"))
            for name, _ in model.named_parameters()}
        assert_loss_and_grads_match(
            (got, summed), (expected, {n: p.grad for n, p in model.named_parameters()}),
            (exact_loss, {n: p.grad for n, p in model64.named_parameters()}),
            f"{family} pp={pp} v={v}", tokens.numel())

    def test_a_long_skip_passes_through_the_middle_stage(self) -> None:
        plan = make_plan("custom", pp=3, m=3)
        model = LongSkip()
        plan = dataclasses.replace(plan, parallel=dataclasses.replace(
            plan.parallel, stage_boundaries=("layers.1", "layers.3")))
        gm, pipeline = split(plan, model=model)
        stages = [stage_info(s) for _, s in pipeline_stages(pipeline)]
        assert [b.name for b in stages[0].outputs] == ["embed", "add"]
        assert [b.name for b in stages[1].inputs] == ["embed", "add"]
        assert [b.name for b in stages[1].outputs] == ["embed", "add_2"]
        # b, s come from the tokens: the last stage reads them itself rather than receive them.
        assert stages[2].data == ("tokens", "targets")
        last = pipeline_stages(pipeline)[2][1]
        assert "tokens.shape" in last.code
        tokens, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
        bind(pipeline, model)
        expected = with_weights(gm, model)(tokens, targets)
        assert_loss_within_rounding(pipeline(tokens, targets), expected,
                                    exact(gm, model)[0](tokens, targets), "long skip",
                                    tokens.numel())


    def test_user_models_split_too(self) -> None:
        """nanoGPT (fx; wte tied to lm_head) and a Hugging Face-style Llama (export door).

        The Llama's position ids and causal mask, made once before the layers,
        cross the cut beside the hidden state, without gradient.
        """
        from tests.user_models.hf_llama import hf_llama  # noqa: PLC0415
        from tests.user_models.nanogpt import nanogpt  # noqa: PLC0415

        torch.manual_seed(0)
        models = {"nanogpt": nanogpt(vocab_size=64, n_embd=32, n_layer=4, n_head=4, block_size=16),
                  "hf_llama": hf_llama(vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=16)}
        tokens, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
        for name, model in models.items():
            gm, pipeline = split(make_plan("custom", pp=2, m=2), model=model)
            first, last = (stage_info(s) for _, s in pipeline_stages(pipeline))
            assert first.data == ("tokens",) and last.data == ("targets",), name
            if name == "nanogpt":
                assert first.tied == (("transformer.wte.weight", "transformer.wte.weight"),)
                assert last.tied == (("lm_head.weight", "transformer.wte.weight"),)
            else:
                assert [(b.shape, b.requires_grad) for b in first.outputs] == [
                    ((1, 16), False), ((2, 1, 16, 16), False), ((2, 16, 32), True)]
            bind(pipeline, model)
            expected = with_weights(gm, model)(tokens, targets)
            # The Llama fills its causal mask in fp32 (torch.full with no dtype): it cannot
            # run in float64, so its bound is the rounding floor alone.
            exact_loss = expected.double() if name == "hf_llama" else \
                exact(gm, model)[0](tokens, targets)
            assert_loss_within_rounding(pipeline(tokens, targets), expected, exact_loss, name,
                                        tokens.numel())


def pinned(plan: Plan, **pins) -> Plan:
    """`plan` with its parallel section's pipeline pins set."""
    return dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, **pins))


def layer_counts(pipeline) -> list[int]:
    return [sum(a.startswith("layers.") for a in stage_info(s).atoms)
            for _, s in pipeline_stages(pipeline)]


class TestCut:
    """The pass applies the cut the plan it is given pins, or the even one (the cost model's
    choice is pinned into that plan before the passes: tests/lower/test_one_cost_path.py)."""

    def test_an_unpinned_plan_is_cut_evenly(self) -> None:
        assert layer_counts(split(make_plan(pp=4, layers=8))[1]) == [2, 2, 2, 2]

    def test_pins_are_kept(self) -> None:
        _, pipeline = split(pinned(make_plan(pp=2), stage_boundaries=("layers.3",)))
        assert stage_info(pipeline_stages(pipeline)[1][1]).atoms[0] == "layers.3"

    def test_plan_stage_boundaries_pin_cuts(self) -> None:
        _, pipeline = split(pinned(make_plan(pp=4), stage_boundaries=(None, "layers.2", None)))
        assert stage_info(pipeline_stages(pipeline)[2][1]).atoms[0] == "layers.2"

    def test_a_cut_at_a_piece_that_is_no_layer(self) -> None:
        _, pipeline = split(pinned(make_plan(pp=2), stage_boundaries=("norm",)))
        assert layer_counts(pipeline) == [4, 0]
        assert stage_info(pipeline_stages(pipeline)[1][1]).atoms[0] == "norm"

    def test_plan_first_and_last_stage_layers_pin_every_cut(self) -> None:
        plan = make_plan(pp=4, layers=8)
        with pytest.raises(PlanError, match=r"layers\(7\) is not divisible by pp\(4\)"):
            dataclasses.replace(plan, model=model_spec(layers=7))
        uneven = dataclasses.replace(plan, model=model_spec(layers=7), parallel=dataclasses.replace(
            plan.parallel, first_stage_layers=1, last_stage_layers=1))
        _, pipeline = split(uneven)
        layers = [[a for a in stage_info(s).atoms if a.startswith("layers.")]
                  for _, s in pipeline_stages(pipeline)]
        assert layers == [["layers.0"], ["layers.1", "layers.2"], ["layers.3", "layers.4",
                                                                   "layers.5"], ["layers.6"]]

    def test_under_interleaving_the_end_counts_are_the_ranks(self) -> None:
        # pp 2, v 2: rank 0 runs stages 0 and 2 and holds first_stage_layers between them.
        plan = make_plan(pp=2, v=2, layers=8)
        plan = dataclasses.replace(plan, model=model_spec(layers=7), parallel=dataclasses.replace(
            plan.parallel, first_stage_layers=3))
        counts = layer_counts(split(plan)[1])
        assert counts == [1, 2, 2, 2]
        assert counts[0] + counts[2] == 3

    @pytest.mark.parametrize("pins,needle", [
        (("layer.3",), r"no graph piece named 'layer.3'.*did you mean"),
        (("layers.2", "layers.1", "layers.3"), r"later stages at later pieces"),
        ((None, "norm", None), r"cut 'norm' \(stage 2\) names no layer.*needs every cut pinned"),
    ])
    def test_bad_pins_are_named(self, pins: tuple, needle: str) -> None:
        plan = make_plan(pp=2 if len(pins) == 1 else 4)
        with pytest.raises(CompileError, match=needle):
            split(pinned(plan, stage_boundaries=pins))


class TestProgram:
    def test_compile_plan_keeps_a_graph_and_a_layout_per_stage(self) -> None:
        program = compile_plan(make_plan(pp=2, zero=3))
        assert [s.index for s in program.stages] == [0, 1]
        assert all(isinstance(s.graph.zero, ZeroShards) for s in program.stages)
        first, last = (s.layout for s in program.stages)
        # The tied weight is a unit of its own on both stages: same geometry, summable shards.
        assert first.units[0].params == ("embed.weight",)
        assert last.units[-1].params == ("head.weight",)
        assert first.units[0].padded_numel == last.units[-1].padded_numel
        assert program.layout.params["embed.weight"].aliases == ("embed.weight", "head.weight")
        assert str(program.schedule).startswith("schedule 1f1b pp=2 v=1 m=4")
        assert any(line.startswith("split_pipeline_pass: stage 1 (rank 1, chunk 0)")
                   for line in program.pass_log)
        assert sum("shard_params_pass: inserted" in line for line in program.pass_log) == 2

    def test_a_tied_weight_gets_a_unit_of_its_own(self) -> None:
        class Head(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.head = nn.Linear(4, 8)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(x)

        layout = param_layout(fx.symbolic_trace(Head()), 2, own_units=("head.weight",))
        assert [(u.name, u.params) for u in layout.units] == [
            ("head.weight", ("head.weight",)), ("head", ("head.bias",))]
