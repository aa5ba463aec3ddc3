"""`ptc.compile(model, mesh)`: a device mesh (a DeviceMesh, or axis names to sizes) and a
model make the plan; a plan given as `base` keeps its sections and takes the mesh's
degrees. What cannot be read off the mesh or the model is a one-line error."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import ptc
from ptc.errors import PtcError
from ptc.lower.mesh_plan import gpu_preset, plan_for_mesh
from ptc.models import build_model
from ptc.plan import HardwareSpec
from tests.user_models.nanogpt import nanogpt
from tests.user_models.transformers_models import llama


def test_a_mapping_makes_the_plan_from_the_model_and_this_machine() -> None:
    model = llama()
    program = ptc.compile(model, {"dp": 2, "tp": 2})  # outermost first, as a DeviceMesh
    plan = program.plan
    par = plan.parallel
    assert (par.dp, par.tp, par.pp, par.cp) == (2, 2, 1, 1)
    assert par.order[:2] == ("tp", "dp")  # innermost first, as ptc orders axes
    assert (plan.hardware.gpu, plan.num_gpus, plan.train.dtype) == ("cpu", 4, "fp32")
    assert (plan.model.vocab, plan.model.max_seq, plan.train.seq_len) == (64, 16, 16)
    rebuilt = build_model(plan.model)  # the plan prices the architecture it was given
    assert type(rebuilt) is type(model)
    assert {n: p.shape for n, p in rebuilt.named_parameters()} == \
        {n: p.shape for n, p in model.named_parameters()}


def test_a_pipeline_gets_a_micro_batch_per_stage() -> None:
    plan = plan_for_mesh(llama(), {"pp": 2, "dp": 1})
    assert plan.parallel.pp == 2 and plan.num_microbatches == 2


def test_a_device_mesh_names_the_axes() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        plan = plan_for_mesh(llama(), mesh)
        unnamed = init_device_mesh("cpu", (1,))
        with pytest.raises(PtcError, match="the mesh's dimensions have no names"):
            plan_for_mesh(llama(), unnamed)
    finally:
        dist.destroy_process_group()
    assert plan.parallel.order[:2] == ("tp", "dp") and plan.hardware.gpu == "cpu"


def test_a_base_plan_keeps_its_sections_and_takes_the_meshs_degrees() -> None:
    base = plan_for_mesh(llama(), {"dp": 4})
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, steps=7))
    plan = ptc.compile(llama(), {"dp": 2, "tp": 2}, base=base).plan
    assert (plan.parallel.dp, plan.parallel.tp, plan.train.steps) == (2, 2, 7)
    with pytest.raises(PtcError, match="the mesh has 2 devices, the plan's hardware 4"):
        plan_for_mesh(llama(), {"dp": 2}, base)


@pytest.mark.parametrize("mesh,message", [
    ({"ep": 2}, r"mesh dimension 'ep' is not an axis ptc splits; valid: tp, cp, dp, pp"),
    ({"dp": 0}, r"mesh dimension 'dp' has size 0; a size is a whole number >= 1"),
    ({"dp": 1.5}, r"mesh dimension 'dp' has size 1.5"),
])
def test_a_mesh_ptc_cannot_read_is_named(mesh, message) -> None:
    with pytest.raises(PtcError, match=message):
        ptc.compile(llama(), mesh)


def test_a_module_ptc_cannot_rebuild_needs_a_plan() -> None:
    with pytest.raises(PtcError, match=r"ptc prices a GPT by rebuilding it, which it can do "
                                       r"for a transformers model only; give a plan"):
        ptc.compile(nanogpt(n_layer=1, n_head=2, n_embd=16, vocab_size=32, block_size=8,
                            bias=True, dropout=0.0), {"dp": 2})
    with pytest.raises(PtcError, match=r"ptc.compile\(None, mesh\): give the model"):
        ptc.compile(None, {"dp": 2})


@pytest.mark.parametrize("name,preset", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA H200", "H200"), ("NVIDIA B200", "B200"),
    ("NVIDIA GB200", "GB200")])
def test_a_gpu_is_found_by_the_name_torch_gives_it(name, preset) -> None:
    assert gpu_preset(name) == preset
    assert HardwareSpec.preset(preset).gpu == preset


def test_an_unknown_gpu_needs_a_plan() -> None:
    with pytest.raises(PtcError, match=r"no one hardware preset for GPU 'Tesla T4'"):
        gpu_preset("Tesla T4")


def test_a_base_given_with_a_plan_is_refused() -> None:
    with pytest.raises(TypeError, match="base= goes with a mesh"):
        ptc.compile(None, plan_for_mesh(llama(), {"dp": 1}), base=plan_for_mesh(llama(), {}))


def test_what_is_neither_a_plan_nor_a_mesh_is_named() -> None:
    with pytest.raises(PtcError, match="a Linear is not a plan, a plan file, a DeviceMesh or "
                                       "a mapping of axis names to sizes"):
        ptc.compile(llama(), nn.Linear(2, 2))
