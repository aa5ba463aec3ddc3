"""Built-in models: published parameter counts, deterministic init, forward shapes."""

import pytest
import torch
import torch.fx

from ptc.errors import PtcError
from ptc.models import build_model, count_parameters, initial_value
from ptc.plan import ModelSpec

LLAMA3_70B = ModelSpec(family="llama", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                       vocab=128256, max_seq=8192, rope_theta=500000.0, tied_embeddings=False)
LLAMA2_7B = ModelSpec(family="llama", layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000,
                      max_seq=4096)
GPT2_124M = ModelSpec(family="gpt", layers=12, hidden=768, heads=12, vocab=50257, max_seq=1024)


def tiny(family: str, **kw) -> ModelSpec:
    """A small spec of either family (GQA for llama)."""
    base = dict(family=family, layers=2, hidden=64, heads=4, vocab=100, max_seq=32)
    if family == "llama":
        base.update(kv_heads=2, ffn=128)
    base.update(kw)
    return ModelSpec(**base)


class TestParameterCounts:
    """Counted on the meta device against the published figures."""

    @pytest.mark.parametrize("spec, published", [
        (LLAMA3_70B, 70_553_706_496),
        (LLAMA2_7B, 6_738_415_616),
        (GPT2_124M, 124_439_808),
    ], ids=["llama3-70b", "llama2-7b", "gpt2-124m"])
    def test_published(self, spec, published):
        model = build_model(spec, device="meta")
        assert all(p.is_meta for p in model.parameters())
        assert count_parameters(model) == published

    def test_gpt_head_is_tied_by_default_and_llama_is_not(self):
        gpt, llama = build_model(tiny("gpt")), build_model(tiny("llama"))
        assert gpt.head.weight is gpt.embed.weight
        assert llama.head.weight is not llama.embed.weight

    def test_untied_gpt_counts_the_head(self):
        tied = count_parameters(build_model(tiny("gpt")))
        untied = count_parameters(build_model(tiny("gpt", tied_embeddings=False)))
        assert untied - tied == 100 * 64


class TestModuleNames:
    """The names plan files glob over."""

    def test_gpt(self):
        names = {n for n, _ in build_model(tiny("gpt")).named_modules()}
        assert {"embed", "pos_embed", "layers.1.attn_norm", "layers.1.attn.qkv", "layers.1.attn.o",
                "layers.1.mlp_norm", "layers.1.mlp.up", "layers.1.mlp.down", "norm",
                "head"} <= names

    def test_llama(self):
        names = {n for n, _ in build_model(tiny("llama")).named_modules()}
        assert {"embed", "layers.1.attn_norm", "layers.1.attn.q", "layers.1.attn.k",
                "layers.1.attn.v", "layers.1.attn.o", "layers.1.mlp_norm", "layers.1.mlp.gate",
                "layers.1.mlp.up", "layers.1.mlp.down", "norm", "head"} <= names

    def test_llama_has_no_bias(self):
        model = build_model(tiny("llama"))
        assert not any(n.endswith("bias") for n, _ in model.named_parameters())


class TestInit:
    """Random init: a function of (seed, parameter name) only."""

    @pytest.mark.parametrize("family", ["gpt", "llama"])
    def test_same_seed_same_tensors(self, family):
        a = build_model(tiny(family), device="cpu", seed=7).state_dict()
        b = build_model(tiny(family), device="cpu", seed=7).state_dict()
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name

    def test_other_seed_other_tensors(self):
        a = build_model(tiny("gpt"), device="cpu", seed=1)
        b = build_model(tiny("gpt"), device="cpu", seed=2)
        assert not torch.equal(a.layers[0].mlp.up.weight, b.layers[0].mlp.up.weight)

    def test_values_do_not_depend_on_other_parameters(self):
        # A pipeline stage holding only some layers computes the same values
        # from the meta model, without building the others.
        meta = build_model(tiny("llama"), device="meta")
        full = build_model(tiny("llama"), device="cpu", seed=3)
        for name, param in full.named_parameters():
            assert torch.equal(initial_value(meta, name, 3), param.detach()), name

    def test_init_rule(self):
        model = build_model(tiny("gpt", layers=8), device="cpu", seed=0)
        assert torch.all(model.layers[0].attn_norm.weight == 1)
        assert torch.all(model.layers[0].attn.qkv.bias == 0)
        assert model.layers[0].mlp.up.weight.std().item() == pytest.approx(0.02, rel=0.1)
        # residual projections are scaled by 1/sqrt(2·layers)
        assert model.layers[0].mlp.down.weight.std().item() == pytest.approx(0.005, rel=0.1)

    def test_tied_after_materialising(self):
        model = build_model(tiny("gpt"), device="cpu", seed=0)
        assert model.head.weight is model.embed.weight

    def test_rope_tables_are_computed(self):
        model = build_model(tiny("llama"), device="cpu", seed=0)
        rope = model.layers[0].attn.rope
        assert torch.allclose(rope.cos[0], torch.ones(16))
        assert torch.allclose(rope.cos[1, 0], torch.cos(torch.tensor(1.0)))


class TestForward:
    """Logits shapes, and that the built-ins trace with plain torch.fx."""

    @pytest.mark.parametrize("family", ["gpt", "llama"])
    def test_logits_shape(self, family):
        model = build_model(tiny(family), device="cpu", seed=0)
        assert model(torch.randint(0, 100, (2, 16))).shape == (2, 16, 100)

    @pytest.mark.parametrize("spec", [tiny("gpt"), tiny("gpt", dropout=0.1, activation="relu"),
                                      tiny("gpt", kv_heads=2), tiny("llama"),
                                      tiny("llama", tied_embeddings=True, kv_heads=None)],
                             ids=["gpt", "gpt-dropout-relu", "gpt-gqa", "llama-gqa", "llama-tied"])
    def test_symbolic_trace_matches_eager(self, spec):
        model = build_model(spec, device="cpu", seed=0).eval()
        traced = torch.fx.symbolic_trace(model)
        tokens = torch.randint(0, 100, (2, 16))
        torch.testing.assert_close(traced(tokens), model(tokens))

    def test_causal(self):
        # Changing a later token must not change earlier logits.
        model = build_model(tiny("llama"), device="cpu", seed=0)
        tokens = torch.randint(0, 100, (1, 8))
        other = tokens.clone()
        other[0, 5] = (other[0, 5] + 1) % 100
        torch.testing.assert_close(model(tokens)[0, :5], model(other)[0, :5])


class TestCustomFactory:
    """family = custom: "package.module:callable" with kwargs."""

    KW = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=100, block_size=32)

    def spec(self, factory="tests.user_models.nanogpt:nanogpt", **kw):
        return ModelSpec(family="custom", factory=factory, kwargs=kw or self.KW)

    def test_meta(self):
        model = build_model(self.spec(), device="meta")
        assert all(p.is_meta for p in model.parameters())

    def test_cpu_is_repeatable(self):
        a = build_model(self.spec(), device="cpu", seed=5)
        b = build_model(self.spec(), device="cpu", seed=5)
        assert torch.equal(a.lm_head.weight, b.lm_head.weight)

    def test_missing_module_names_the_factory(self):
        with pytest.raises(PtcError, match="no_such_pkg.models:make"):
            build_model(self.spec(factory="no_such_pkg.models:make"))

    def test_missing_callable_names_the_factory(self):
        with pytest.raises(PtcError, match="tests.user_models.nanogpt:nope"):
            build_model(self.spec(factory="tests.user_models.nanogpt:nope"))

    def test_failing_call_names_the_factory_and_kwargs(self):
        with pytest.raises(PtcError, match=r"nanogpt:nanogpt.*n_heads=4.*TypeError"):
            build_model(self.spec(n_heads=4))
