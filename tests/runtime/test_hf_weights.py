"""`init = hf(dir)`: a save_pretrained directory (one file or shards) read by the module's names.

The values are the saved module's own, bit for bit, whether `save_pretrained`
wrote one safetensors file or several shards with an index; a directory that
is not one is refused in one line naming `train.init`, before any process
starts (`check_init`). The whole round trip through training under tp x pp
is tests/distributed/test_hf_roundtrip.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ptc.dsl import parse  # noqa: E402
from ptc.dsl.dump import dump_plan  # noqa: E402
from ptc.errors import PtcError  # noqa: E402
from ptc.plan import HardwareSpec, InitSpec, ModelSpec, Plan, TrainSpec  # noqa: E402
from ptc.runtime.hf_weights import SafetensorsState  # noqa: E402
import ptc  # noqa: E402
from ptc.lower.preflight import check_init  # noqa: E402
from ptc.models import build_model  # noqa: E402
from ptc.runtime.init import check_buffers, initial_buffers, reference_model  # noqa: E402
from tests.user_models.transformers_models import gpt2, llama  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["one file", "sharded"])
def test_values_are_the_saved_modules(tmp_path, shard):
    torch.manual_seed(0)
    model = llama()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    state = SafetensorsState(tmp_path)
    for name, param in model.named_parameters():
        assert torch.equal(state[name], param.detach()), name


def test_a_tied_head_is_saved_once_and_found_under_the_embedding(tmp_path):
    model = gpt2()
    model.save_pretrained(tmp_path)
    state = SafetensorsState(tmp_path)
    assert "transformer.wte.weight" in state and "lm_head.weight" not in state


def _plan(init: InitSpec) -> Plan:
    return Plan(model=ModelSpec(family="custom", factory="tests.user_models."
                                "transformers_models:llama"),
                hardware=HardwareSpec.preset("cpu", gpus_per_node=1), train=TrainSpec(seq_len=16, global_batch=4, init=init))


def test_bad_directories_are_refused_naming_the_field(tmp_path):
    with pytest.raises(PtcError, match=r"^train.init: hf\(\".*nowhere\"\): not a directory"):
        check_init(_plan(InitSpec(kind="hf", path=str(tmp_path / "nowhere"))))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PtcError, match=r"no model.safetensors or model.safetensors.index.json "
                                       r"in it \(found \['config.json'\]\)"):
        check_init(_plan(InitSpec(kind="hf", path=str(tmp_path))))
    with pytest.raises(PtcError, match=r"^train.init: state_dict\(\".*w.pt\"\): no such file"):
        check_init(_plan(InitSpec(kind="state_dict", path=str(tmp_path / "w.pt"))))


def test_weights_of_another_shape_are_refused_before_any_process_starts(tmp_path):
    # The plan's factory builds the model on meta (no memory) to read its names and shapes.
    llama(hidden_size=48, head_dim=12).save_pretrained(tmp_path)
    plan = _plan(InitSpec(kind="hf", path=str(tmp_path)))
    with pytest.raises(PtcError, match=r"^train.init: .*: model.embed_tokens.weight has shape "
                                       r"\(64, 48\), the model needs \(64, 32\)$"):
        check_init(plan)
    check_init(plan, factory=False)  # the workers are sent a module: its names are its own
    llama().save_pretrained(tmp_path)
    check_init(plan)


def test_the_plan_language_reads_and_writes_hf_init():
    text = ('model "tests.user_models.transformers_models:llama" { }\n'
            'hardware { gpu = cpu; gpus_per_node = 1 }\n'
            'train { seq_len = 16; global_batch = 4; init = hf("weights/llama") }\n')
    plan = parse(text)
    assert plan.train.init == InitSpec(kind="hf", path="weights/llama")
    assert parse(dump_plan(plan)).train.init == plan.train.init


def test_a_rank_reads_a_custom_models_buffers_without_building_its_weights(tmp_path):
    # With weights from a file, the factory's model is only wanted for its buffers: its
    # parameters stay on meta (no rank holds a whole model), its rotary table is computed.
    llama().save_pretrained(tmp_path)
    model = reference_model(_plan(InitSpec(kind="hf", path=str(tmp_path))), build_model)
    assert all(p.is_meta for p in model.parameters())
    buffers = dict(model.named_buffers())
    assert not buffers["model.rotary_emb.inv_freq"].is_meta
    assert torch.equal(buffers["model.rotary_emb.inv_freq"],
                       dict(llama().named_buffers())["model.rotary_emb.inv_freq"])
    assert not any(p.is_meta for p in llama().parameters())  # registration restored after


class _Wrapped(torch.nn.Module):
    """A user's wrapper around a transformers model: (tokens, targets) -> (logits, loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = llama()

    def forward(self, tokens, targets):
        logits = self.lm(input_ids=tokens).logits
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_transformers_model_built_on_meta_gets_the_buffers_its_config_computes(tmp_path):
    # Built under torch.device("meta") (its rotary table too) and inside a user's wrapper:
    # the table is what its class computes from its config, in the buffer's dtype.
    with torch.device("meta"):
        module = _Wrapped().to(torch.bfloat16)
    plan = _plan(InitSpec(kind="state_dict", path=str(tmp_path / "w.pt")))
    torch.save(_Wrapped().state_dict(), tmp_path / "w.pt")  # no rotary table: not persistent
    graph = ptc.compile(module, plan).stages[0].graph
    check_buffers(graph, plan, module)
    got = initial_buffers(graph, plan, module)["lm.model.rotary_emb.inv_freq"]
    want = _Wrapped().to(torch.bfloat16).get_buffer("lm.model.rotary_emb.inv_freq")
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert all(b.is_meta for b in module.buffers()) and all(p.is_meta for p in module.parameters())
