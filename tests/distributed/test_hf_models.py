"""Real Hugging Face `transformers` models train under ptc's layouts exactly as in eager PyTorch.

Tiny configs built in-process (tests/user_models/transformers_models): a Llama
(grouped-query attention, RoPE, SwiGLU, untied head; captured through the
export door, whose graph creates its causal mask and positions with device
literals), GPT-2 (Conv1D projections, fused qkv, tied head, learned
positions), Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, whose weights get
their gradient summed over tp), Phi-3 (fused qkv sliced, fused gate_up
chunked), GPT-J and Cohere (rotary on interleaved pairs: strided slices stacked
back) and OLMo 2 (a q/k norm across the heads: its attention kept whole by
shard rules, its MLP split); one Llama has a pad token, whose embedding row
gets no gradient, also when the table is vocabulary-parallel; a vocabulary of
63 tokens is padded to 64 rows under tp2, the padding row's logit left out of
the loss. GPT-2 also trains with dropout on: each sample's masks are the
same under every layout as in the eager run (`ptc.ops.dropout`). With one key/value
head, fewer than tp, the heads are replicated (in SDPA's grouped-query form and in
the eager attention's repeated heads). Mixtral's experts (stacked weights
applied by a grouped product) are split as MLPs under tp, their top-2 router
kept whole; with sequence parallelism each MoE block runs on the whole
sequence (gathered at its input, its output scattered back); with context
parallelism (Mixtral, Qwen3-MoE, and with ep over the cp ranks) each rank routes
its own chunks' token rows (`ptc.passes.grouped_rows`). bf16 plans are compared with eager training by ptc's bf16 recipe
(bf16 compute, AdamW on fp32 masters), within bounds derived from that run's
own distance to fp64 (`tests/tolerances.py`). The module given to
`ptc.compile` is what trains: the loss of
every step and every parameter after 5 AdamW steps equal eager training of
that module from the same weights on the same samples, within the bounds
`tests/tolerances.py` derives from the same run in float64. Their `labels`
argument is left None (the model would shift ptc's targets a second time);
the next-token loss is ptc's. All cases run on 2 gloo processes, three
launches in all (each within its test's time limit).

More families train under tp (most with sequence parallelism), pp or ZeRO-3:
sliding-window attention (Mistral, Gemma 3, Cohere 2, EXAONE 4), biased projections
(StarCoder2), scalar multipliers (Granite), q/k/v clipped in place (OLMo: `clamp_`
keeps the heads apart), ALiBi built per head (MPT), squared-ReLU MLPs (Nemotron),
per-head q/k LayerNorms (Persimmon), layers without rotary (SmolLM3) and learned
positions (BioGPT). StableLM, whose per-head norms are one module per head, trains
with its attention kept whole by a rule; without it, a CompileError names that rule.
And Gemma, CodeGen (its qkv in groups), ERNIE 4.5, Hunyuan, Arcee, Qwen3-MoE, GPT-Neo
(scores masked by where(causal, scores, min); split by heads under tp), GPT-OSS (attention sinks: splitting them by heads or the sequence
is refused in one line naming them), PhiMoE and
GraniteMoE (its forward takes `use_cache` through **kwargs: capture sets it off), GLM,
LFM2 (short convolutions) and Mamba (a state-space scan, no attention). Newer ones:
DeepSeek-V3 (multi-head latent attention, sigmoid-routed experts) under pp, ZeRO-3 and
tp (with sequence parallelism too: its low-rank latents and rotary key computed whole,
split by heads from its up projections on, as Megatron-Core splits MLA),
GLM-4, Apertus (xIELU: learned scalars through softplus, read on the split MLP activations,
so their gradient is summed over tp), NanoChat, OLMoE, BitNet and VaultGemma.

Falcon picks each group's key/value head out of its fused qkv with index
lists (tensor constants the graph keeps with their values) and writes its
linears as `x @ w.T`; BLOOM adds an ALiBi bias built for all heads. Both
train under tp with their attention kept whole by a `shard ... replicate`
rule and their MLP split, as does GPT-BigCode (one key/value head fused with
the queries). With sequence parallelism too (BLOOM, Falcon), the attention kept
whole gets its inputs gathered along the sequence and its output scattered
back, as does Mamba's mixer (a convolution along the sequence) kept whole.

A Llama with its embedding, its first attention and its last norm frozen
(requires_grad = False) fine-tunes as eager PyTorch does: those parameters
keep their values under ZeRO 1-3, tp + sp and pp, in fp32 and bf16.

OLMo 2's attention cannot be split by heads without its rules: that is a
CompileError naming the linears, the op that mixes the heads and the `shard`
rule that keeps them whole; BLOOM's is a CompileError naming the op where
the bias meets the rank's heads and the same rule.
"""

from __future__ import annotations

import pytest
from dist_helpers import assert_same_training, reference
from hf_helpers import HFCase, hf_module, hf_plan, run_hf_cases

from ptc.errors import CaptureError, CompileError
from ptc.lower.driver import compile_plan
from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

_MQA, _EAGER = (("num_key_value_heads", 1),), (("attn_implementation", "eager"),)
_FALCON_NEW = (("new_decoder_architecture", True), ("num_kv_heads", 2))
_FALCON_ATTENTION_WHOLE = (("transformer.h.*.self_attention.*", "replicate"),)
_DROPOUT = (("embd_pdrop", 0.1), ("resid_pdrop", 0.1), ("attn_pdrop", 0.1))
LAUNCHES = {"layouts": [
    HFCase("llama", dp=2, zero=1), HFCase("llama", dp=2, zero=3), HFCase("llama", tp=2),
    HFCase("llama", tp=2, sp=True, checkpoint="full"), HFCase("llama", pp=2),
    # a padding row (no gradient) in a vocabulary-parallel embedding
    HFCase("llama", tp=2, config=(("pad_token_id", 1),)),
    HFCase("gpt2", dp=2, zero=1), HFCase("gpt2", dp=2, zero=3), HFCase("gpt2", pp=2),
    HFCase("gpt2", tp=2), HFCase("gpt2", tp=2, sp=True), HFCase("qwen2", tp=2, sp=True),
    HFCase("qwen3", tp=2), HFCase("phi3", tp=2),
    # a vocabulary not divisible by tp: padded with a row no token reaches (untied, tied + sp)
    HFCase("llama", tp=2, config=(("vocab_size", 63),)),
    HFCase("gpt2", tp=2, sp=True, config=(("vocab_size", 63),)),
    HFCase("olmo2", tp=2, shards=(("model.layers.*.self_attn.*_proj", "replicate"),)),
    # dropout on (embedding, residual, and inside scaled_dot_product_attention)
    HFCase("gpt2", dp=2, zero=3, config=_DROPOUT), HFCase("gpt2", tp=2, sp=True, config=_DROPOUT),
    HFCase("gpt2", pp=2, checkpoint="full", config=_DROPOUT),
    # the zero-bubble schedule: each backward split into input and weight gradients
    HFCase("llama", pp=2, schedule="zero_bubble"),
    HFCase("gpt2", pp=2, schedule="zero_bubble", config=_DROPOUT),
    # ZB-V: 4 layers, one per stage, rank 0 holding the first and the last (GPT-2's tied
    # embedding and head on one rank)
    HFCase("llama", pp=2, schedule="zbv", config=(("num_hidden_layers", 4),)),
    HFCase("gpt2", pp=2, schedule="zbv", config=(*_DROPOUT, ("n_layer", 4))),
    HFCase("llama", pp=2, schedule="dualpipev", config=(("num_hidden_layers", 4),)),
    HFCase("gpt2", pp=2, schedule="dualpipev", config=(*_DROPOUT, ("n_layer", 4))),
], "structures": [
    # one key/value head for two ranks: replicated (SDPA's grouped-query form; the eager
    # attention's repeated heads; q/k/v biases; a per-head k norm on the replicated path)
    HFCase("llama", tp=2, config=_MQA), HFCase("llama", tp=2, sp=True, config=_MQA + _EAGER),
    HFCase("qwen2", tp=2, sp=True, config=_MQA), HFCase("qwen3", tp=2, config=_MQA),
    # kept whole by rules: each rank's heads taken where they meet, the gradient summed there
    HFCase("llama", tp=2, config=_MQA, shards=(("model.layers.*.self_attn.[kv]_proj",
                                                "replicate"),)),
    # a mixture of experts: router replicated, each expert's MLP split as an MLP
    HFCase("mixtral", tp=2), HFCase("mixtral", dp=2, zero=3),
    HFCase("mixtral", pp=2, checkpoint="full"), HFCase("mixtral", pp=2, schedule="zero_bubble"),
    # with sequence parallelism: each MoE block gathered whole, its experts split over tp,
    # its output scattered back (a shared expert beside them in Qwen2-MoE)
    HFCase("mixtral", tp=2, sp=True), HFCase("qwen2_moe", tp=2, sp=True),
    # with context parallelism: each rank routes the token rows of its chunks, grouped by
    # expert and put back on the rank (with ep: exchanged between the two cp ranks); a
    # load-balancing loss in the model's own loss: tests/distributed/test_cp_equivalence.py
    HFCase("mixtral", cp=2), HFCase("qwen3_moe", cp=2), HFCase("mixtral", cp=2, ep=2),
], "families": [
    # more families: soft-capping (Gemma 2), shared experts behind a scalar gate
    # (Qwen2-MoE), a per-head interleaved qkv (GPT-NeoX), dropout on flattened token rows
    # and offset positions (OPT, dropout 0.1 by default), partial rotary (Phi), rotary on
    # interleaved pairs (GPT-J, Cohere)
    HFCase("gemma2", tp=2, sp=True), HFCase("qwen2_moe", tp=2), HFCase("gpt_neox", tp=2, sp=True),
    HFCase("opt", tp=2, sp=True), HFCase("opt", dp=2), HFCase("phi", tp=2), HFCase("gptj", tp=2),
    HFCase("cohere", tp=2, sp=True),
], "families kept whole in part": [
    # index lists picking each group's key/value head out of a fused qkv (Falcon: its
    # `x @ w.T` linears split under tp, its attention kept whole), ALiBi built for all heads
    # (BLOOM), one key/value head fused with the queries (GPT-BigCode): attention whole,
    # MLP split
    HFCase("falcon", dp=2, zero=3), HFCase("falcon", pp=2),
    HFCase("falcon", tp=2, config=_FALCON_NEW, shards=_FALCON_ATTENTION_WHOLE),
    HFCase("bloom", tp=2, shards=(("transformer.h.*.self_attention.*", "replicate"),)),
    HFCase("gpt_bigcode", tp=2, shards=(("transformer.h.*.attn.*", "replicate"),)),
    HFCase("gpt_bigcode", dp=2, zero=1),
    # with sequence parallelism: the whole attention's inputs gathered along the sequence,
    # its output scattered back (Falcon adds the MLP's output to it in place)
    HFCase("bloom", tp=2, sp=True, shards=(("transformer.h.*.self_attention.*", "replicate"),)),
    HFCase("falcon", tp=2, sp=True, config=_FALCON_NEW, shards=_FALCON_ATTENTION_WHOLE),
], "more families": [
    # a sliding window (Mistral; Gemma 3, Cohere 2 alternating it with full layers; EXAONE 4),
    # biases and LayerNorm (StarCoder2), scalar multipliers (Granite), q/k/v clipped in
    # place (OLMo), per-head ALiBi (MPT), squared ReLU and LayerNorm1P (Nemotron), per-head
    # q/k LayerNorms after a fused qkv (Persimmon), layers without rotary (SmolLM3),
    # scaled embeddings and learned positions (BioGPT)
    HFCase("mistral", tp=2, sp=True), HFCase("gemma3", tp=2, sp=True), HFCase("gemma3", pp=2),
    HFCase("cohere2", tp=2, sp=True), HFCase("exaone4", tp=2), HFCase("starcoder2", tp=2, sp=True),
    HFCase("granite", pp=2), HFCase("olmo", tp=2), HFCase("olmo", dp=2, zero=3),
    HFCase("mpt", tp=2, sp=True), HFCase("nemotron", tp=2, sp=True),
    HFCase("persimmon", tp=2, sp=True), HFCase("smollm3", pp=2, checkpoint="full"),
    HFCase("biogpt", tp=2, sp=True),
    # their own dropout sites on: residual, embedding and attention (StarCoder2), hidden and
    # attention probabilities (BioGPT)
    HFCase("starcoder2", tp=2, sp=True, config=(("residual_dropout", 0.1),
                                                ("embedding_dropout", 0.1),
                                                ("attention_dropout", 0.1))),
    HFCase("biogpt", dp=2, zero=3, config=(("hidden_dropout_prob", 0.1),
                                           ("attention_probs_dropout_prob", 0.1))),
    # per-head q/k norms as one module per head: the attention kept whole, the MLP split
    HFCase("stablelm", tp=2, shards=(("model.layers.*.self_attn.*", "replicate"),)),
], "and more": [
    # GeGLU and (1 + w) norms (Gemma), a qkv in 4 groups of (q, v, k) rows (CodeGen),
    # interleaved rotary (ERNIE 4.5), per-head q/k norms after rotary (Hunyuan), squared
    # ReLU without gate (Arcee), Qwen3-MoE's experts, local attention layers (GPT-Neo),
    # attention sinks and clamped SwiGLU experts (GPT-OSS), a sparsemixer router (PhiMoE)
    HFCase("gemma", tp=2, sp=True), HFCase("codegen", tp=2), HFCase("ernie4_5", tp=2, sp=True),
    HFCase("hunyuan", tp=2, sp=True), HFCase("arcee", tp=2, sp=True), HFCase("qwen3_moe", tp=2),
    HFCase("gpt_neo", pp=2), HFCase("gpt_neo", tp=2), HFCase("gpt_oss", dp=2, zero=3),
    HFCase("phimoe", pp=2),
    HFCase("codegen", dp=2, zero=3),
], "and beyond": [
    # GraniteMoE, whose forward takes `use_cache` only through **kwargs; GLM's fused gate_up
    # and half-head rotary, LFM2's convolutions, Mamba's scan (no attention at all)
    HFCase("granitemoe", tp=2), HFCase("granitemoe", pp=2),
    HFCase("glm", tp=2, sp=True), HFCase("lfm2", pp=2), HFCase("mamba", pp=2),
    HFCase("mamba", dp=2, zero=3),
    # its mixer kept whole under sequence parallelism: the convolution along the sequence
    # gets it whole
    HFCase("mamba", tp=2, sp=True, shards=(("backbone.layers.*.mixer*", "replicate"),)),
], "newer families": [
    # multi-head latent attention and sigmoid-routed experts (DeepSeek-V3: its latents whole,
    # its up projections split by heads, its rotary key expanded to each rank's heads),
    # sandwich norms (GLM-4), xIELU (Apertus), squared ReLU with q/k norms
    # without weights (NanoChat), experts with q/k norms across the heads (OLMoE), norms
    # inside attention and MLP (BitNet), Gemma without soft-capping (VaultGemma)
    HFCase("deepseek_v3", pp=2), HFCase("deepseek_v3", dp=2, zero=3),
    HFCase("deepseek_v3", tp=2), HFCase("deepseek_v3", tp=2, sp=True),
    HFCase("glm4", tp=2, sp=True), HFCase("apertus", tp=2, sp=True),
    HFCase("nanochat", tp=2, sp=True), HFCase("olmoe", pp=2), HFCase("bitnet", dp=2, zero=3),
    HFCase("vaultgemma", tp=2, sp=True),
], "frozen": [
    # parameters with requires_grad = False keep their values (no gradient, no weight decay)
    HFCase("llama_partly_frozen", dp=2, zero=1), HFCase("llama_partly_frozen", dp=2, zero=3),
    HFCase("llama_partly_frozen", tp=2, sp=True), HFCase("llama_partly_frozen", pp=2),
    HFCase("llama_partly_frozen", dp=2, zero=2, dtype="bf16"),
], "bf16": [
    # bf16 plans (bf16 compute, fp32 masters) against the same recipe in eager PyTorch
    HFCase("llama", tp=2, config=_MQA, dtype="bf16"), HFCase("llama", dp=2, zero=3, dtype="bf16"),
    HFCase("gpt2", pp=2, dtype="bf16"), HFCase("gpt2", tp=2, sp=True, config=_DROPOUT, dtype="bf16"),
    HFCase("mixtral", tp=2, dtype="bf16"),
]}
CASES = [(launch, case) for launch, cases in LAUNCHES.items() for case in cases]
BATCHES = (("layouts", "structures"), ("families", "families kept whole in part",
                                       "more families"),
           ("and more", "and beyond", "newer families", "frozen", "bf16"))
"""The groups above, by the launch that trains them: process start-up is paid three times,
and the ranks of a launch profile its models two at a time (`dist_helpers.profile_ahead`)."""
_runs: dict = {}


def _results(launch: str) -> dict:
    batch = next(b for b in BATCHES if launch in b)
    if batch not in _runs:
        cases = [case for group in batch for case in LAUNCHES[group]]
        _runs[batch] = run_local(run_hf_cases, 2, cases)[0]
    return _runs[batch]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launch,case", CASES, ids=[str(case) for _, case in CASES])
def test_trains_like_eager_pytorch(launch: str, case: HFCase) -> None:
    got = _results(launch)[case]
    assert_same_training(got, reference(hf_plan(case), hf_module(case)), what=str(case))


def _assert_refused(case: HFCase, pattern: str) -> None:
    """Compiling `case` is a CompileError whose text matches `pattern`."""
    with pytest.raises(CompileError, match=pattern):
        compile_plan(hf_plan(case), model=hf_module(case))


def test_a_loss_term_the_appended_loss_would_drop_is_refused() -> None:
    """transformers adds the routers' load-balancing loss (`output_router_logits`) to its
    loss only when given labels; ptc appends its cross-entropy to the logits, which would
    train without it: refused in one line saying what to do (a model whose forward returns
    its whole loss trains it: `mixtral_router_loss`)."""
    case = HFCase("mixtral", dp=2, config=(("output_router_logits", True),))
    with pytest.raises(CaptureError, match=r"^model MixtralForCausalLM: its forward returns "
                       r"'aux_loss', a loss term .* output_router_logits = False"):
        compile_plan(hf_plan(case), model=hf_module(case))


def test_a_norm_across_heads_is_refused_naming_the_op_and_the_rule() -> None:
    _assert_refused(HFCase("olmo2", tp=2), r"linear 'model.layers.0.self_attn.q_proj' \(node "
                    r"\w+\) \(and 1 more like it\): .* through mean .*"
                    r"'model.layers.0.self_attn.q_norm'.*\n.*shard "
                    r"\"model.layers.\*.self_attn.q_proj\" replicate")


def test_a_bias_built_for_all_heads_is_refused_naming_the_op_and_the_rule() -> None:
    """BLOOM's ALiBi bias has every head's rows; the rank's scores have its own heads."""
    _assert_refused(HFCase("bloom", tp=2), r"node baddbmm \(baddbmm\) in module "
                    r"'transformer.h.0.self_attention' at .*modeling_bloom"
                    r".*cannot run on the rank-local shapes.*; to keep "
                    r"module 'transformer.h.0.self_attention' whole add "
                    r"to the parallel section: shard "
                    r"\"transformer.h.\*.self_attention.\*\" replicate$")


def test_heads_split_into_one_module_each_are_refused_naming_the_attention_rule() -> None:
    """StableLM norms each head with its own module: the rule keeps the attention whole."""
    _assert_refused(HFCase("stablelm", tp=2), r"node split \(split\) in module "
                    r"'model.layers.0.self_attn.q_layernorm' .* cannot "
                    r"follow: split size 1 is not divisible by 2; to keep "
                    r"module 'model.layers.0.self_attn' whole add to the "
                    r"parallel section: shard "
                    r"\"model.layers.\*.self_attn.\*\" replicate$")

