"""`init = hf(dir)` of a mixture of experts that transformers itself saved.

transformers 5 holds a layer's experts stacked (`...mlp.experts.gate_up_proj` [E, 2F, H],
`...mlp.experts.down_proj` [E, H, F]) but `save_pretrained` writes them one expert at a
time in the hub's layout (Mixtral: `...block_sparse_moe.experts.{e}.w1.weight`, w3, w2;
Qwen3-MoE, OLMoE, Qwen2-MoE: `...mlp.experts.{e}.gate_proj.weight`, up_proj, down_proj).
The reader presents the module's own names, by transformers' own conversion rules for the
directory's model type, each stacked tensor built from its pieces when asked for: every
parameter reads back bit for bit, its shape known without reading a piece, and a
directory that lacks one expert's tensor is refused in one line naming the parameter.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ptc.errors import PtcError  # noqa: E402
from ptc.lower.preflight import check_init  # noqa: E402
from ptc.plan import HardwareSpec, InitSpec, ModelSpec, Plan, TrainSpec  # noqa: E402
from ptc.runtime.hf_weights import SafetensorsState  # noqa: E402
from tests.user_models import transformers_models  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MOE = {
    "mixtral": "model.layers.0.block_sparse_moe.experts.0.w1.weight",
    "qwen3_moe": "model.layers.0.mlp.experts.0.gate_proj.weight",
    "olmoe": "model.layers.0.mlp.experts.0.gate_proj.weight",
    "qwen2_moe": "model.layers.0.mlp.experts.0.gate_proj.weight",
}
"""Families, each with a per-expert name its save_pretrained writes."""


def _saved(tmp_path: Path, family: str, shard: str | None = None, **config):
    torch.manual_seed(0)
    model = getattr(transformers_models, family)(**config)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    return model


def _plan(family: str, path: Path) -> Plan:
    return Plan(model=ModelSpec(family="custom",
                                factory=f"tests.user_models.transformers_models:{family}"),
                hardware=HardwareSpec.preset("cpu", gpus_per_node=1),
                train=TrainSpec(seq_len=16, global_batch=4,
                                init=InitSpec(kind="hf", path=str(path))))


@pytest.mark.parametrize("family", list(MOE))
def test_every_parameter_reads_back_under_the_modules_name(tmp_path, family):
    model = _saved(tmp_path, family)
    state = SafetensorsState(tmp_path)
    assert MOE[family] not in state  # saved per expert, read stacked
    stacked = [n for n, _ in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert len(stacked) == model.config.num_hidden_layers
    for name, param in model.named_parameters():
        assert name in state, name
        assert state.shape(name) == tuple(param.shape), name
        value = state[name]
        assert value.shape == param.shape and torch.equal(value, param.detach()), name
    assert set(state) == {n for n, _ in model.named_parameters()}
    check_init(_plan(family, tmp_path))  # the preflight used to say "no weights for ..."


def test_twelve_experts_sharded_stack_in_the_experts_order(tmp_path):
    # Experts 10 and 11 come after 9 (transformers' natural order), whichever shard
    # each piece is in.
    model = _saved(tmp_path, "mixtral", "20KB", num_local_experts=12)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    state = SafetensorsState(tmp_path)
    for name, param in model.named_parameters():
        assert torch.equal(state[name], param.detach()), name


def test_a_stacked_tensor_reads_only_its_pieces_and_its_shape_none(tmp_path, monkeypatch):
    _saved(tmp_path, "mixtral")
    state = SafetensorsState(tmp_path)
    read = []
    original = SafetensorsState._read
    monkeypatch.setattr(SafetensorsState, "_read",
                        lambda self, key: read.append(key) or original(self, key))
    assert state.shape("model.layers.1.mlp.experts.down_proj") == (4, 32, 64)
    assert read == []
    state["model.layers.1.mlp.experts.down_proj"]
    assert read == [f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight" for e in range(4)]


def test_a_dense_llama_reads_as_saved(tmp_path):
    model = _saved(tmp_path, "llama")
    state = SafetensorsState(tmp_path)
    assert list(state) == list(load_file(tmp_path / "model.safetensors"))
    for name, param in model.named_parameters():
        assert state.shape(name) == tuple(param.shape)
        assert torch.equal(state[name], param.detach()), name
    assert "model.layers.0.mlp.experts.gate_up_proj" not in state
    with pytest.raises(KeyError):
        state["model.layers.0.mlp.experts.gate_up_proj"]


def test_a_missing_experts_tensor_is_refused_in_one_line_naming_the_parameter(tmp_path):
    _saved(tmp_path, "mixtral")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    state = SafetensorsState(tmp_path)
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 32)  # intact
    message = (r"^train.init: hf\(\".*\"\): model.layers.1.mlp.experts.gate_up_proj: no "
               r"model.layers.1.block_sparse_moe.experts.2.w3.weight \(3 of 4 found")
    with pytest.raises(PtcError, match=message) as caught:
        state["model.layers.1.mlp.experts.gate_up_proj"]
    assert "\n" not in str(caught.value)
    with pytest.raises(PtcError, match=message):
        check_init(_plan("mixtral", tmp_path))
    assert state["model.layers.1.mlp.experts.down_proj"].shape == (4, 32, 64)  # complete
