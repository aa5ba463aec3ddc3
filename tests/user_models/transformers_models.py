"""Tiny configs of real Hugging Face `transformers` models, built in-process (no hub).

Factories for `family = custom` (`tests.user_models.transformers_models:llama`):
module-level, so spawned workers can import them. Each family is here for a
structure the compiler must find in the graph: grouped-query attention and
RoPE (Llama), Conv1D projections with a fused qkv (GPT-2), q/k/v biases
(Qwen2), per-head q/k norms (Qwen3), fused qkv and gate_up projections cut
by slices and chunks (Phi-3), a mixture of experts with a top-2 router (Mixtral),
plus shared experts behind a scalar gate (Qwen2-MoE), soft-capped attention scores
and logits (Gemma 2), a fused qkv interleaved per head and a parallel attention/MLP
block (GPT-NeoX), learned positions with an offset and a padding row (OPT), partial
rotary and one norm for attention and MLP (Phi), rotary on interleaved pairs
(rotate-every-two: strided slices stacked back, GPT-J and Cohere), a fused qkv
whose one key/value head is picked by index lists (Falcon, `x[..., [-2], :]`:
constants forward builds from Python values) and linears written `x @ w.T`,
ALiBi position bias (BLOOM), one key/value head fused with the queries
(GPT-BigCode). More decoders, each with something of its own: a sliding window
over half the sequence (Mistral; Gemma 3 and Cohere 2 alternating it with full
layers; EXAONE 4), biased projections and LayerNorm (StarCoder2), scalar
multipliers on embeddings, residuals, scores and logits (Granite), q, k and v
clipped in place and a norm without weights (OLMo), ALiBi built per head (MPT),
squared-ReLU MLP and LayerNorm1P (Nemotron), per-head q/k LayerNorms after a
fused qkv (Persimmon), per-head q/k norms as one module per head (StableLM),
layers without rotary (SmolLM3), scaled embeddings and learned positions (BioGPT).
And GeGLU with (1 + w) norms (Gemma), a qkv laid out in groups (CodeGen), interleaved
rotary (ERNIE 4.5), per-head norms after rotary (Hunyuan), squared ReLU (Arcee), experts
behind routers of their own (Qwen3-MoE, GPT-OSS with attention sinks, PhiMoE, GraniteMoE,
whose forward takes `use_cache` through **kwargs), local attention (GPT-Neo), a fused
gate_up with half-head interleaved rotary (GLM), short convolutions beside attention
(LFM2), and no attention at all: a state-space scan (Mamba). Newer ones: multi-head latent
attention (low-rank queries and keys/values, rotary on a slice of each head) with a dense
first layer and sigmoid-routed experts beside shared ones (DeepSeek-V3), norms after
attention and MLP as well as before (GLM-4), the xIELU activation (Apertus), squared-ReLU
MLPs and q/k norms without weights (NanoChat), experts with q/k norms (OLMoE), norms inside
attention and MLP (BitNet), and a Gemma without soft-capping (VaultGemma). And a model whose
own loss adds its routers' load-balancing loss over the batch (`mixtral_router_loss`).
"""

import torch
from transformers import (ApertusConfig, ApertusForCausalLM, BitNetConfig, BitNetForCausalLM,
                          DeepseekV3Config, DeepseekV3ForCausalLM, Glm4Config, Glm4ForCausalLM,
                          NanoChatConfig, NanoChatForCausalLM, OlmoeConfig, OlmoeForCausalLM,
                          VaultGemmaConfig, VaultGemmaForCausalLM)
from transformers import (ArceeConfig, ArceeForCausalLM, BioGptConfig, BioGptForCausalLM,
                          BloomConfig, BloomForCausalLM, CodeGenConfig, CodeGenForCausalLM,
                          Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM,
                          Ernie4_5Config, Ernie4_5ForCausalLM, Exaone4Config, Exaone4ForCausalLM,
                          FalconConfig, FalconForCausalLM, Gemma2Config, Gemma2ForCausalLM,
                          Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig, GemmaForCausalLM,
                          GlmConfig, GlmForCausalLM, GPT2Config, GPT2LMHeadModel, GPTBigCodeConfig,
                          GPTBigCodeForCausalLM, GPTJConfig, GPTJForCausalLM, GPTNeoConfig,
                          GPTNeoForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, GptOssConfig,
                          GptOssForCausalLM, GraniteConfig, GraniteForCausalLM, GraniteMoeConfig,
                          GraniteMoeForCausalLM, HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM,
                          Lfm2Config, Lfm2ForCausalLM, LlamaConfig, LlamaForCausalLM, MambaConfig,
                          MambaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, MptConfig, MptForCausalLM, NemotronConfig,
                          NemotronForCausalLM, Olmo2Config, Olmo2ForCausalLM, OlmoConfig,
                          OlmoForCausalLM, OPTConfig, OPTForCausalLM, PersimmonConfig,
                          PersimmonForCausalLM, Phi3Config, Phi3ForCausalLM, PhiConfig,
                          PhiForCausalLM, PhimoeConfig, PhimoeForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, SmolLM3Config,
                          SmolLM3ForCausalLM, StableLmConfig, StableLmForCausalLM,
                          Starcoder2Config, Starcoder2ForCausalLM)

VOCAB, SEQ = 64, 16

_DECODER = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": SEQ, "bos_token_id": 0, "eos_token_id": 0}
"""A 2-layer decoder with grouped-query attention: 4 query over 2 key/value heads."""


def llama(**overrides) -> LlamaForCausalLM:
    """Llama: grouped-query attention, RoPE, SwiGLU, untied head."""
    return LlamaForCausalLM(LlamaConfig(**_DECODER | overrides))


def llama_partly_frozen(**overrides) -> LlamaForCausalLM:
    """Llama fine-tuned with parts frozen (requires_grad = False): the token embedding, the
    first layer's attention projections and the last norm's weight."""
    model = llama(**overrides)
    model.get_input_embeddings().requires_grad_(False)
    model.model.layers[0].self_attn.requires_grad_(False)
    model.model.norm.weight.requires_grad_(False)
    return model


def qwen2(**overrides) -> Qwen2ForCausalLM:
    """Qwen2: Llama's layout with biases on the q, k and v projections."""
    return Qwen2ForCausalLM(Qwen2Config(**_DECODER | overrides))


def qwen3(**overrides) -> Qwen3ForCausalLM:
    """Qwen3: an RMSNorm over each query and key head before RoPE."""
    return Qwen3ForCausalLM(Qwen3Config(**_DECODER | {"head_dim": 8} | overrides))


def phi3(**overrides) -> Phi3ForCausalLM:
    """Phi-3: one fused qkv projection sliced into q, k, v; one gate_up projection chunked."""
    return Phi3ForCausalLM(Phi3Config(**_DECODER | {"pad_token_id": None} | overrides))


def gpt2(**overrides) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 (Conv1D projections, fused qkv, tied head, learned positions)."""
    config = {"vocab_size": VOCAB, "n_positions": SEQ, "n_embd": 32, "n_layer": 2, "n_head": 4,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0,
              "eos_token_id": 0, **overrides}
    return GPT2LMHeadModel(GPT2Config(**config))


def olmo2(**overrides) -> Olmo2ForCausalLM:
    """OLMo 2: an RMSNorm over the whole q and k projections, across the heads."""
    return Olmo2ForCausalLM(Olmo2Config(**_DECODER | overrides))


def mixtral(**overrides) -> MixtralForCausalLM:
    """Mixtral: each layer's MLP is 4 experts (stacked gate_up and down weights, applied by
    a grouped product) behind a top-2 router."""
    return MixtralForCausalLM(MixtralConfig(**_DECODER | {"num_local_experts": 4,
                                                          "num_experts_per_tok": 2} | overrides))


def mixtral_one_sided(**overrides) -> MixtralForCausalLM:
    """Mixtral whose routers are frozen at zero: every score ties, so every token of every
    step goes to the first top-k experts (0 and 1) and the ranks holding the others, under
    expert parallelism, receive no token at all."""
    model = mixtral(**overrides)
    for layer in model.model.layers:
        torch.nn.init.zeros_(layer.mlp.gate.weight)
        layer.mlp.gate.requires_grad_(False)
    return model


class RouterLossLM(torch.nn.Module):
    """A causal LM trained on its next-token loss plus its routers' load-balancing loss:
    transformers' `aux_loss` (the fraction of top-k choices and the mean probability of each
    expert, over every token of the batch) times the config's `router_aux_loss_coef`.
    forward(tokens, targets) returns (logits, loss), so that ptc trains the model's loss."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        self.config = lm.config  # what a reference run reads (the experts' implementation)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor):
        out = self.lm(tokens, output_router_logits=True)
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
        return out.logits, loss + self.lm.config.router_aux_loss_coef * out.aux_loss


def mixtral_router_loss(**overrides) -> RouterLossLM:
    """Mixtral with its load-balancing loss in the loss, weighted 0.1 (a hundred times the
    default, so that a difference in it shows)."""
    return RouterLossLM(mixtral(**{"router_aux_loss_coef": 0.1} | overrides))


def qwen2_moe(**overrides) -> Qwen2MoeForCausalLM:
    """Qwen2-MoE: 4 routed experts (top-2) and a shared expert scaled by a sigmoid gate."""
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**_DECODER | {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64} | overrides))


def gemma2(**overrides) -> Gemma2ForCausalLM:
    """Gemma 2: soft-capped attention scores and logits, embeddings scaled by sqrt(h),
    norms around both sublayers, a tied head."""
    return Gemma2ForCausalLM(Gemma2Config(**_DECODER | {"head_dim": 8} | overrides))


def gpt_neox(**overrides) -> GPTNeoXForCausalLM:
    """GPT-NeoX: a fused qkv whose output is [heads, 3, head_dim], attention and MLP in
    parallel from the same residual."""
    return GPTNeoXForCausalLM(GPTNeoXConfig(**_DECODER | overrides))


def opt(**overrides) -> OPTForCausalLM:
    """OPT: learned positions offset by 2, a padding row in the token embedding."""
    return OPTForCausalLM(OPTConfig(**_DECODER | {"ffn_dim": 64, "word_embed_proj_dim": 32,
                                                  "pad_token_id": 1} | overrides))


def phi(**overrides) -> PhiForCausalLM:
    """Phi-2: partial rotary, attention and MLP in parallel after one LayerNorm, biases."""
    return PhiForCausalLM(PhiConfig(**_DECODER | overrides))


def gptj(**overrides) -> GPTJForCausalLM:
    """GPT-J: rotary on interleaved pairs of a head's first features (x[..., ::2] and
    x[..., 1::2] stacked back and flattened), attention and MLP in parallel."""
    return GPTJForCausalLM(GPTJConfig(**{"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2,
                                         "n_head": 4, "n_positions": SEQ, "rotary_dim": 4,
                                         "bos_token_id": 0, "eos_token_id": 0} | overrides))


def cohere(**overrides) -> CohereForCausalLM:
    """Cohere (Command R): interleaved rotary as GPT-J's, a bias-free LayerNorm feeding
    attention and MLP in parallel, logits scaled."""
    return CohereForCausalLM(CohereConfig(**_DECODER | overrides))


def falcon(**overrides) -> FalconForCausalLM:
    """Falcon: fused qkv with one key/value head picked by index lists, parallel attention/MLP."""
    return FalconForCausalLM(FalconConfig(**{"vocab_size": VOCAB, "hidden_size": 32,
                                             "num_hidden_layers": 2, "num_attention_heads": 4,
                                             "max_position_embeddings": SEQ, "bos_token_id": 0,
                                             "eos_token_id": 0} | overrides))


def bloom(**overrides) -> BloomForCausalLM:
    """BLOOM: ALiBi position bias, built for all heads, added to the scores by `baddbmm`."""
    return BloomForCausalLM(BloomConfig(**{"vocab_size": VOCAB, "hidden_size": 32, "n_layer": 2,
                                           "n_head": 4, "bos_token_id": 0, "eos_token_id": 0}
                                        | overrides))


def gpt_bigcode(**overrides) -> GPTBigCodeForCausalLM:
    """GPT-BigCode (StarCoder): multi-query attention, its one key/value head fused with the
    queries in c_attn."""
    return GPTBigCodeForCausalLM(GPTBigCodeConfig(**{
        "vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": SEQ,
        "n_inner": 64, "bos_token_id": 0, "eos_token_id": 0} | overrides))



_WINDOW = {"sliding_window": SEQ // 2}
"""A sliding window over half the sequence: the mask differs from the causal one."""


def mistral(**overrides) -> MistralForCausalLM:
    """Mistral: Llama's layout attending over a sliding window."""
    return MistralForCausalLM(MistralConfig(**_DECODER | _WINDOW | overrides))


def gemma3(**overrides) -> Gemma3ForCausalLM:
    """Gemma 3 (text): sliding-window and full layers with their own rotary tables,
    per-head q/k norms, GeGLU, embeddings scaled by sqrt(h)."""
    return Gemma3ForCausalLM(Gemma3TextConfig(**_DECODER | _WINDOW | {
        "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window_pattern": 2} | overrides))


def cohere2(**overrides) -> Cohere2ForCausalLM:
    """Cohere 2 (Command R7B): sliding-window layers with interleaved rotary, full layers
    without it, attention and MLP in parallel."""
    return Cohere2ForCausalLM(Cohere2Config(**_DECODER | _WINDOW | {"sliding_window_pattern": 2}
                                            | overrides))


def exaone4(**overrides) -> Exaone4ForCausalLM:
    """EXAONE 4: norms after attention and MLP, per-head q/k norms, sliding-window layers."""
    return Exaone4ForCausalLM(Exaone4Config(**_DECODER | _WINDOW | {"head_dim": 8,
                                                                    "pad_token_id": 1}
                                            | overrides))


def starcoder2(**overrides) -> Starcoder2ForCausalLM:
    """StarCoder2: biased projections, LayerNorm, a GELU MLP, grouped-query attention."""
    return Starcoder2ForCausalLM(Starcoder2Config(**_DECODER | _WINDOW | {
        "residual_dropout": 0.0, "embedding_dropout": 0.0} | overrides))


def granite(**overrides) -> GraniteForCausalLM:
    """Granite: scalar multipliers on the embeddings, residual branches, attention scores
    and logits."""
    return GraniteForCausalLM(GraniteConfig(**_DECODER | {
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 4.0,
        "attention_multiplier": 0.3} | overrides))


def olmo(**overrides) -> OlmoForCausalLM:
    """OLMo: q, k and v clipped in place (`clamp_`), LayerNorm without weights."""
    return OlmoForCausalLM(OlmoConfig(**_DECODER | {"clip_qkv": 2.0, "pad_token_id": 1}
                                      | overrides))


def mpt(**overrides) -> MptForCausalLM:
    """MPT: ALiBi built per head and added to the scores, a fused qkv, no biases."""
    return MptForCausalLM(MptConfig(**{"vocab_size": VOCAB, "d_model": 32, "n_heads": 4,
                                       "n_layers": 2, "expansion_ratio": 2, "max_seq_len": SEQ}
                                    | overrides))


def nemotron(**overrides) -> NemotronForCausalLM:
    """Nemotron: a squared-ReLU MLP without gate, LayerNorm1P (1 + w), partial rotary."""
    return NemotronForCausalLM(NemotronConfig(**_DECODER | {"head_dim": 8} | overrides))


def persimmon(**overrides) -> PersimmonForCausalLM:
    """Persimmon: a fused qkv viewed per head, per-head q/k LayerNorms, partial rotary."""
    return PersimmonForCausalLM(PersimmonConfig(**_DECODER | {"qk_layernorm": True}
                                                | overrides))


def stablelm(**overrides) -> StableLmForCausalLM:
    """StableLM: per-head q/k LayerNorms, one module per head (the heads split apart and
    concatenated back), attention and MLP in parallel, partial rotary."""
    return StableLmForCausalLM(StableLmConfig(**_DECODER | {
        "qk_layernorm": True, "use_parallel_residual": True} | overrides))


def smollm3(**overrides) -> SmolLM3ForCausalLM:
    """SmolLM3: every second layer without rotary (NoPE)."""
    return SmolLM3ForCausalLM(SmolLM3Config(**_DECODER | {"no_rope_layer_interval": 2,
                                                          "pad_token_id": 1} | overrides))


def biogpt(**overrides) -> BioGptForCausalLM:
    """BioGPT: embeddings scaled by sqrt(h), learned positions offset by 2, LayerNorm."""
    return BioGptForCausalLM(BioGptConfig(**_DECODER | {
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "pad_token_id": 1}
        | overrides))


def gemma(**overrides) -> GemmaForCausalLM:
    """Gemma: GeGLU with tanh GELU, RMSNorm scaling by (1 + w), embeddings scaled by sqrt(h)."""
    return GemmaForCausalLM(GemmaConfig(**_DECODER | {"head_dim": 8} | overrides))


def codegen(**overrides) -> CodeGenForCausalLM:
    """CodeGen: one qkv projection laid out in 4 groups of (q, v, k) rows, rotary on
    interleaved pairs of part of each head, attention and MLP in parallel."""
    return CodeGenForCausalLM(CodeGenConfig(**{
        "vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4,
        "n_positions": SEQ, "n_ctx": SEQ, "bos_token_id": 0, "eos_token_id": 0} | overrides))


def ernie4_5(**overrides) -> Ernie4_5ForCausalLM:
    """ERNIE 4.5: Llama's layout with rotary on interleaved pairs."""
    return Ernie4_5ForCausalLM(Ernie4_5Config(**_DECODER | {"head_dim": 8} | overrides))


def hunyuan(**overrides) -> HunYuanDenseV1ForCausalLM:
    """Hunyuan (dense): an RMSNorm over each query and key head after rotary."""
    return HunYuanDenseV1ForCausalLM(HunYuanDenseV1Config(**_DECODER | {"head_dim": 8}
                                                          | overrides))


def arcee(**overrides) -> ArceeForCausalLM:
    """Arcee (AFM): a squared-ReLU MLP without gate on Llama's attention."""
    return ArceeForCausalLM(ArceeConfig(**_DECODER | overrides))


def qwen3_moe(**overrides) -> Qwen3MoeForCausalLM:
    """Qwen3-MoE: per-head q/k norms, experts behind a top-2 softmax router."""
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**_DECODER | {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16} | overrides))


def gpt_neo(**overrides) -> GPTNeoForCausalLM:
    """GPT-Neo: global and local (windowed) attention layers in turn, scores not scaled."""
    return GPTNeoForCausalLM(GPTNeoConfig(**{
        "vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
        "attention_types": [[["global", "local"], 1]], "window_size": SEQ // 2,
        "max_position_embeddings": SEQ, "bos_token_id": 0, "eos_token_id": 0} | overrides))


def gpt_oss(**overrides) -> GptOssForCausalLM:
    """GPT-OSS: attention sinks, sliding and full layers in turn, experts with a clamped
    SwiGLU behind a top-2 router."""
    return GptOssForCausalLM(GptOssConfig(**_DECODER | {
        "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": SEQ // 2}
        | overrides))


def phimoe(**overrides) -> PhimoeForCausalLM:
    """PhiMoE: experts behind a sparsemixer router, LayerNorm."""
    return PhimoeForCausalLM(PhimoeConfig(**_DECODER | {
        "num_local_experts": 4, "num_experts_per_tok": 2} | overrides))


def granitemoe(**overrides) -> GraniteMoeForCausalLM:
    """GraniteMoE: Granite's scalar multipliers, experts behind a top-2 router, and a forward
    that takes `use_cache` only through **kwargs."""
    return GraniteMoeForCausalLM(GraniteMoeConfig(**_DECODER | {
        "num_local_experts": 4, "num_experts_per_tok": 2} | overrides))


def glm(**overrides) -> GlmForCausalLM:
    """GLM: a fused gate_up projection, rotary on interleaved pairs of half of each head."""
    return GlmForCausalLM(GlmConfig(**_DECODER | {"head_dim": 8, "pad_token_id": 1}
                                    | overrides))


def mamba(**overrides) -> MambaForCausalLM:
    """Mamba: no attention, a selective state-space scan over the sequence (a loop on CPU)."""
    return MambaForCausalLM(MambaConfig(**{
        "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 4,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1} | overrides))


def lfm2(**overrides) -> Lfm2ForCausalLM:
    """LFM2: gated short convolutions in some layers, attention in the others."""
    return Lfm2ForCausalLM(Lfm2Config(**_DECODER | {
        "layer_types": ["conv", "full_attention"], "pad_token_id": 1} | overrides))


_NO_PAD = {"pad_token_id": None}


def deepseek_v3(**overrides) -> DeepseekV3ForCausalLM:
    """DeepSeek-V3: multi-head latent attention (queries and keys/values through low-rank
    projections, rotary on a slice of each head), a dense first layer, then experts behind
    a sigmoid router beside a shared expert."""
    return DeepseekV3ForCausalLM(DeepseekV3Config(**_DECODER | _NO_PAD | {
        "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "first_k_dense_replace": 1, "n_group": 1,
        "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4, "v_head_dim": 8} | overrides))


def glm4(**overrides) -> Glm4ForCausalLM:
    """GLM-4: GLM's layer with norms after attention and MLP as well as before."""
    return Glm4ForCausalLM(Glm4Config(**_DECODER | _NO_PAD | overrides))


def apertus(**overrides) -> ApertusForCausalLM:
    """Apertus: an MLP with the xIELU activation (learned parameters) and no gate."""
    return ApertusForCausalLM(ApertusConfig(**_DECODER | _NO_PAD | overrides))


def nanochat(**overrides) -> NanoChatForCausalLM:
    """NanoChat: squared-ReLU MLPs, q/k norms without weights."""
    return NanoChatForCausalLM(NanoChatConfig(**_DECODER | _NO_PAD | overrides))


def olmoe(**overrides) -> OlmoeForCausalLM:
    """OLMoE: q/k norms across the heads, experts behind a top-2 softmax router."""
    return OlmoeForCausalLM(OlmoeConfig(**_DECODER | _NO_PAD | {
        "num_experts": 4, "num_experts_per_tok": 2} | overrides))


def bitnet(**overrides) -> BitNetForCausalLM:
    """BitNet: norms inside attention (before o_proj) and inside the MLP (before down)."""
    return BitNetForCausalLM(BitNetConfig(**_DECODER | _NO_PAD | overrides))


def vaultgemma(**overrides) -> VaultGemmaForCausalLM:
    """VaultGemma: Gemma's layer (GeGLU, (1 + w) norms, scaled embeddings)."""
    return VaultGemmaForCausalLM(VaultGemmaConfig(**_DECODER | _NO_PAD | {"head_dim": 8}
                                                  | overrides))
