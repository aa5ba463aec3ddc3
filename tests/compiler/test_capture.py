"""Capture: annotations against hand-computed FLOPs and shapes, the loss, both doors, errors.

How the loss is checked against eager: the graph is captured on meta, then
bound to a materialised model of the same module paths with `with_weights`
(which shares that model's parameters and buffers) and run on CPU; its loss
must equal F.cross_entropy of the eager model's logits (or the model's own
loss, for models that compute one).
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ptc.compiler.capture import capture, export_door, with_weights
from ptc.compiler.graph.meta import graph_info
from ptc.compiler.records.graph_meta import NodeInfo
from ptc.compiler.graph.meta import info
from ptc.errors import CaptureError
from ptc.models import build_model
from ptc.plan import ModelSpec
from tests.user_models.hf_llama import hf_llama
from tests.user_models.nanogpt import nanogpt
from tests.user_models.untraceable import Untraceable

B, S, H, A, V = 2, 16, 64, 4, 100
GPT = ModelSpec(family="gpt", layers=2, hidden=H, heads=A, vocab=V, max_seq=32)
LLAMA = ModelSpec(family="llama", layers=2, hidden=H, heads=A, kv_heads=2, ffn=128, vocab=V,
                  max_seq=32)
NANO = dict(n_layer=2, n_head=A, n_embd=H, vocab_size=V, block_size=32)
HF = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
          num_attention_heads=A, num_key_value_heads=2, max_position_embeddings=32)


@pytest.fixture(scope="module")
def gpt_gm():
    return capture(build_model(GPT), micro_batch=B, seq_len=S)


@pytest.fixture(scope="module")
def llama_gm():
    return capture(build_model(LLAMA), micro_batch=B, seq_len=S)


def by_path(gm, path, kind=None):
    """Nodes whose module path is `path` (and kind, if given)."""
    return [n for n in gm.graph.nodes
            if info(n).module_path == path and (kind is None or info(n).kind == kind)]


def one(nodes):
    assert len(nodes) == 1, nodes
    return nodes[0]


def tokens_and_targets(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


class TestAnnotations:
    """NodeInfo of a 2-layer GPT, h=64, a=4, s=16, b=2, checked by hand."""

    def test_every_node_annotated_once(self, gpt_gm):
        assert all(isinstance(n.meta.get("ptc"), NodeInfo) for n in gpt_gm.graph.nodes)

    @pytest.mark.parametrize("path, fan_in, fan_out", [
        ("layers.0.attn.qkv", H, 3 * H), ("layers.1.attn.o", H, H),
        ("layers.1.mlp.up", H, 4 * H), ("layers.0.mlp.down", 4 * H, H), ("head", H, V)])
    def test_linear(self, gpt_gm, path, fan_in, fan_out):
        node = one(by_path(gpt_gm, path))
        i = info(node)
        assert (node.op, i.kind, i.module_type) == ("call_module", "linear", "Linear")
        assert i.flops == 2 * B * S * fan_in * fan_out
        assert i.shapes == ((B, S, fan_out),) and i.dtypes == (torch.float32,)
        bias = 0 if path == "head" else fan_out
        assert i.params == fan_in * fan_out + bias
        assert i.param_bytes == 4 * i.params

    @pytest.mark.parametrize("layer", [0, 1])
    def test_layer_index_and_paths(self, gpt_gm, layer):
        for node in gpt_gm.graph.nodes:
            i = info(node)
            if i.module_path.startswith(f"layers.{layer}."):
                assert i.layer == layer, node
        outside = by_path(gpt_gm, "head") + by_path(gpt_gm, "embed")
        assert all(info(n).layer is None for n in outside)

    def test_written_out_attention(self, gpt_gm):
        matmuls = by_path(gpt_gm, "layers.0.attn", "matmul") + by_path(gpt_gm, "layers.0.attn",
                                                                       "attention")
        assert len(matmuls) == 2
        d = H // A
        assert [info(n).flops for n in matmuls] == [2 * B * A * S * S * d] * 2  # QK^T, then PV
        assert sum(info(n).flops for n in matmuls) == 4 * B * A * S * S * d
        softmax = one(by_path(gpt_gm, "layers.0.attn", "softmax"))
        assert info(softmax).shapes == ((B, A, S, S),)
        assert info(softmax).flops == B * A * S * S  # one per element

    def test_sdpa_attention(self, llama_gm):
        node = one(by_path(llama_gm, "layers.1.attn", "attention"))
        assert info(node).flops == 4 * B * A * S * S * (H // A)  # causal still counted in full
        assert info(node).shapes == ((B, A, S, H // A),)

    def test_norms_embedding_and_params(self, llama_gm):
        norm = one(by_path(llama_gm, "layers.0.attn_norm"))
        assert (info(norm).kind, info(norm).module_type) == ("norm", "RMSNorm")
        assert info(norm).params == H and info(norm).flops == B * S * H
        embed = one(by_path(llama_gm, "embed"))
        assert (info(embed).kind, info(embed).flops, info(embed).params) == ("embedding", 0, V * H)
        assert info(embed).shapes == ((B, S, H),)

    def test_views_are_free(self, llama_gm):
        views = [n for n in llama_gm.graph.nodes if info(n).kind == "view"]
        assert views and all(info(n).flops == 0 for n in views)

    def test_source_lines(self, llama_gm):
        q = one(by_path(llama_gm, "layers.0.attn.q"))
        assert info(q).source.endswith(".py:" + info(q).source.rsplit(":", 1)[1])
        assert "ptc/models/llama.py" in info(q).source

    def test_repeated_layers_annotated_alike(self, llama_gm):
        # The evaluator reuses layer 0's results for layer 1; the records must agree.
        def strip(n):
            i = info(n)
            return (n.op, i.kind, i.module_path.replace("layers.1", "layers.0"), i.shapes,
                    i.dtypes, i.flops, i.params)
        layer0 = [strip(n) for n in llama_gm.graph.nodes if info(n).layer == 0]
        layer1 = [strip(n) for n in llama_gm.graph.nodes if info(n).layer == 1]
        assert layer0 == layer1

    def test_graph_info(self, gpt_gm):
        cap = graph_info(gpt_gm)
        assert (cap.front_door, cap.blocks_path, cap.num_layers) == ("fx", "layers", 2)
        assert cap.vocab == V
        assert (cap.micro_batch, cap.seq_len, cap.with_loss, cap.model_loss) == (B, S, True, False)

    def test_loss_nodes_keep_model_paths(self, gpt_gm):
        placeholders = [n.target for n in gpt_gm.graph.nodes if n.op == "placeholder"]
        assert placeholders == ["tokens", "targets"]
        loss = gpt_gm.graph.output_node().args[0]
        assert (info(loss).kind, info(loss).module_path, info(loss).shapes) == ("loss", "", ((),))
        # no node is attributed to a wrapper module
        assert not any(info(n).module_path.startswith(("model.", "wrapper"))
                       for n in gpt_gm.graph.nodes)


class TestDtypeAndDevice:
    def test_bf16_capture(self):
        gm = capture(build_model(LLAMA), micro_batch=B, seq_len=S, dtype="bf16")
        q = one(by_path(gm, "layers.0.attn.q"))
        assert info(q).dtypes == (torch.bfloat16,)
        assert info(q).param_bytes == 2 * info(q).params

    def test_real_model_is_not_touched_or_copied(self):
        model = build_model(GPT, device="cpu", seed=0)
        before = model.layers[0].mlp.up.weight
        gm = capture(model, micro_batch=B, seq_len=S, dtype=torch.bfloat16)
        assert all(p.is_meta for p in gm.parameters())
        assert model.layers[0].mlp.up.weight is before and before.dtype == torch.float32


class TestLossMatchesEager:
    """The with_loss graph, bound to real weights, computes the eager loss."""

    @pytest.mark.parametrize("spec", [GPT, LLAMA], ids=["gpt", "llama"])
    @pytest.mark.parametrize("door", ["fx", "export"])
    def test_builtin(self, spec, door):
        gm = capture(build_model(spec), micro_batch=B, seq_len=S, front_door=door)
        assert graph_info(gm).front_door == door
        real = build_model(spec, device="cpu", seed=1)
        tokens, targets = tokens_and_targets()
        expected = F.cross_entropy(real(tokens).flatten(0, 1), targets.flatten())
        torch.testing.assert_close(with_weights(gm, real)(tokens, targets), expected)

    @pytest.mark.parametrize("door", ["fx", "export"])
    def test_a_16_bit_models_loss_runs_on_its_float32_logits(self, door):
        """As torchtitan, Megatron-LM and transformers compute it: in bf16 the loss would
        move in steps of 1/64 near 4. The same ops as eager on the same values: equal."""
        gm = capture(build_model(LLAMA), micro_batch=B, seq_len=S, dtype=torch.bfloat16,
                     front_door=door)
        real = build_model(LLAMA, device="cpu", seed=1).to(torch.bfloat16)
        tokens, targets = tokens_and_targets()
        with torch.no_grad():
            loss = with_weights(gm, real)(tokens, targets)
            logits = real(tokens)
        assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
        assert torch.equal(loss, F.cross_entropy(logits.flatten(0, 1).float(),
                                                 targets.flatten()))

    def test_without_loss_returns_logits(self):
        gm = capture(build_model(LLAMA), micro_batch=B, seq_len=S, with_loss=False)
        assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["tokens"]
        real = build_model(LLAMA, device="cpu", seed=1)
        tokens, _ = tokens_and_targets()
        torch.testing.assert_close(with_weights(gm, real)(tokens), real(tokens))


class _InPlace(nn.Module):
    """A forward that writes into a tensor (its result unused) and reads the tensor after."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed, self.head = nn.Embedding(V, S), nn.Linear(S, V)  # hidden = seq: square

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * 2.0
        if self.kind == "clamp_":  # as OLMo clips q, k and v
            x.clamp_(-0.1, 0.1)
        elif self.kind == "mul_ of a slice":  # writes into x through a view
            x[..., :4].mul_(0.0)
        elif self.kind == "transpose_":  # other strides, the same [b, 16, 16] shape
            x.transpose_(1, 2)
        elif self.kind == "unsqueeze_ read before and after":
            before = x + 1.0
            x.unsqueeze_(0)
            x = x[0] + before
        return self.head(x)


@pytest.mark.parametrize("kind", ["clamp_", "mul_ of a slice", "transpose_",
                                  "unsqueeze_ read before and after"])
@pytest.mark.parametrize("door", ["fx", "export"])
def test_a_call_that_writes_into_a_tensor_is_kept_and_read_after(kind, door):
    """Its result is unused, but its effect is not: dead-code elimination keeps it, and the
    shapes of what reads the tensor after it are evaluated after it. The graph runs the
    same ops as eager in the same order, so the losses agree to float32 rounding."""
    model = _InPlace(kind)
    gm = capture(model, micro_batch=B, seq_len=S, front_door=door)
    tokens, targets = tokens_and_targets()
    expected = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(with_weights(gm, model)(tokens, targets), expected)


class TestUserModels:
    def test_nanogpt_through_fx_with_its_own_loss(self):
        with torch.device("meta"):
            model = nanogpt(**NANO)
        gm = capture(model, micro_batch=B, seq_len=S)
        cap = graph_info(gm)
        assert (cap.front_door, cap.model_loss, cap.blocks_path) == ("fx", True, "transformer.h")
        c_fc = one(by_path(gm, "transformer.h.1.mlp.c_fc"))
        assert (info(c_fc).layer, info(c_fc).flops) == (1, 2 * B * S * H * 4 * H)
        torch.manual_seed(0)
        real = nanogpt(**NANO)
        tokens, targets = tokens_and_targets()
        torch.testing.assert_close(with_weights(gm, real)(tokens, targets),
                                   real(tokens, targets)[1])

    def test_nanogpt_logits_need_targets(self):
        # nanoGPT returns last-position logits without targets; capture passes them.
        with torch.device("meta"):
            model = nanogpt(**NANO)
        gm = capture(model, micro_batch=B, seq_len=S, with_loss=False)
        assert info(gm.graph.output_node().args[0]).shapes == ((B, S, V),)
        assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["tokens"]

    def test_hf_llama_through_export(self):
        with torch.device("meta"):
            model = hf_llama(**HF)
        gm = capture(model, micro_batch=B, seq_len=S)
        cap = graph_info(gm)
        # Its loss would shift the (already shifted) targets again: ptc's own loss instead.
        assert (cap.front_door, cap.model_loss, cap.blocks_path, cap.num_layers) == \
            ("export", False, "model.layers", 2)
        q = one([n for n in by_path(gm, "model.layers.1.self_attn.q_proj")
                 if n.op == "call_function"])
        assert (info(q).kind, info(q).layer, info(q).flops) == ("linear", 1, 2 * B * S * H * H)
        assert "hf_llama.py" in info(q).source
        torch.manual_seed(0)
        real = hf_llama(**HF)
        tokens, targets = tokens_and_targets()
        torch.testing.assert_close(with_weights(gm, real)(tokens, targets), F.cross_entropy(
            real(tokens).logits.flatten(0, 1), targets.flatten()))

    def test_leaf_module_keeps_untraceable_python(self):
        class Scale(nn.Module):
            def forward(self, x):
                return x / float(x.size(-1)) ** 0.5  # float() of a traced size: fx cannot

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(V, H)
                self.scale = Scale()
                self.head = nn.Linear(H, V)

            def forward(self, tokens):
                return self.head(self.scale(self.embed(tokens)))

        assert graph_info(capture(Net(), micro_batch=B, seq_len=S)).front_door == "export"
        gm = capture(Net(), micro_batch=B, seq_len=S, leaf_modules=(Scale,))
        scale = one(by_path(gm, "scale"))
        assert graph_info(gm).front_door == "fx"
        assert (scale.op, info(scale).kind, info(scale).shapes) == ("call_module", "other",
                                                                    ((B, S, H),))


class TestErrors:
    def test_data_dependent_branch_names_module_and_line(self):
        with pytest.raises(CaptureError) as err:
            capture(Untraceable(), micro_batch=B, seq_len=S)
        text = str(err.value)
        assert "'layers.0.gate' (Gate)" in text
        assert "tests/user_models/untraceable.py:14" in text
        assert "if y.sum() > 0:" in text
        assert "torch.where" in text and "torch.cond" in text

    def test_export_door_reports_the_same_place(self):
        with pytest.raises(CaptureError) as err:
            capture(Untraceable(), micro_batch=B, seq_len=S, front_door="export")
        text = str(err.value)
        assert "'layers.0.gate' (Gate)" in text
        assert "tests/user_models/untraceable.py:14" in text and "torch.export:" in text

    def test_forced_fx_door_failure_says_how_to_fix(self):
        with torch.device("meta"):
            model = hf_llama(**HF)
        with pytest.raises(CaptureError) as err:
            capture(model, micro_batch=B, seq_len=S, front_door="fx")
        text = str(err.value)
        assert "hf_llama.py" in text and "finfo" in text
        assert "leaf_modules" in text

    def test_a_tensor_built_from_an_index_list_keeps_its_values(self):
        torch.manual_seed(0)
        real = _Pick()
        gm = capture(_Pick(), micro_batch=B, seq_len=S, with_loss=False)
        constants = graph_info(gm).constants
        assert [c.tolist() for c in constants.values()] == [[-2]]  # real, not meta
        for name, value in constants.items():  # the runtime binds constants as buffers
            real.register_buffer(name, value)
        tokens = torch.randint(0, 32, (B, S))
        torch.testing.assert_close(with_weights(gm, real)(tokens), real(tokens))

    def test_an_index_list_whose_values_stay_lost_is_refused_with_the_fix(self, monkeypatch):
        # Where the second export (fake CPU tensors) cannot recover a constant, capture refuses.
        monkeypatch.setattr(export_door, "_constant_values", lambda root, a, k, constants: constants)
        with pytest.raises(CaptureError, match=r"module '_Pick' builds a tensor from Python "
                                               r"values at .*test_capture.py:\d+ .*x\[\.\.\., "
                                               r"-2:-1\]"):
            capture(_Pick(), micro_batch=B, seq_len=S, with_loss=False)

    def test_forward_argument_without_default(self):
        class Two(nn.Module):
            def forward(self, tokens, mask):
                return tokens

        with pytest.raises(CaptureError, match="'mask'"):
            capture(Two(), micro_batch=B, seq_len=S)

    def test_no_logits(self):
        class Pooled(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(V, H)

            def forward(self, tokens):
                return self.embed(tokens).mean(1)

        with pytest.raises(CaptureError, match=r"\[2, 16, vocab\]"):
            capture(Pooled(), micro_batch=B, seq_len=S)


class _Pick(nn.Module):
    """Falcon's qkv[..., [-2], :]: the index list becomes a tensor constant of the graph."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)

    def forward(self, tokens):
        x = self.embed(tokens)
        torch.finfo(x.dtype)  # python the fx door cannot trace: the export door opens
        return x[..., [-2]] * x


class _Unpacks(nn.Module):
    """Unpacks a shape and a chunk."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(V, H), nn.Linear(H // 2, V)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        b, s, h = x.shape
        left, right = x.chunk(2, dim=-1)
        logits = self.head((left * right)[..., : h // 2]).view(b * s, -1)
        return F.cross_entropy(logits, targets.view(b * s))


def test_unpacking_a_traced_value_takes_as_many_values_as_the_line_names():
    """`b, s, h = x.shape` and `left, right = x.chunk(2)` trace to 3 and 2 getitems,
    as fx's own tracer makes them."""
    gm = capture(_Unpacks(), micro_batch=B, seq_len=S)
    getitems = [n for n in gm.graph.nodes if n.op == "call_function"
                and n.target.__name__ == "getitem"]
    assert [n.args[1] for n in getitems][:5] == [0, 1, 2, 0, 1]
    ours = [str(n.target) for n in gm.graph.nodes if n.op.startswith("call")]
    plain = [str(n.target) for n in torch.fx.symbolic_trace(_Unpacks()).graph.nodes
             if n.op.startswith("call")]
    assert ours == plain


class _FlagsThroughKwargs(nn.Module):
    """A forward that takes use_cache only through **kwargs, as GraniteMoE's does."""

    def __init__(self, config_flags: dict):
        super().__init__()
        self.config = type("Config", (), config_flags)()

    def forward(self, input_ids, labels=None, **kwargs):  # noqa: D102 - a test model's
        return input_ids


def test_flags_a_forward_takes_through_kwargs_are_set_where_its_config_defines_them():
    from ptc.compiler.capture.call import call_rule

    rule = call_rule(_FlagsThroughKwargs({"use_cache": True, "output_attentions": True}))
    assert rule.concrete == {"labels": None, "use_cache": False, "output_attentions": False}
    # a module without such a config gets nothing it might not accept
    assert call_rule(_FlagsThroughKwargs({})).concrete == {"labels": None}
