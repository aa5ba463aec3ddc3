"""Tiny configs of real Hugging Face `transformers` models, built in-process (no hub).

Factories for `family = custom` (`tests.user_models.transformers_models:llama`):
module-level, so spawned workers can import them.
"""

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 64, 16


def llama(**overrides) -> LlamaForCausalLM:
    """A 2-layer Llama with grouped-query attention (4 query over 2 key/value heads), untied."""
    config = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": SEQ, "bos_token_id": 0, "eos_token_id": 0,
              **overrides}
    return LlamaForCausalLM(LlamaConfig(**config))


def gpt2(**overrides) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 (Conv1D projections, fused qkv, tied head, learned positions)."""
    config = {"vocab_size": VOCAB, "n_positions": SEQ, "n_embd": 32, "n_layer": 2, "n_head": 4,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0,
              "eos_token_id": 0, **overrides}
    return GPT2LMHeadModel(GPT2Config(**config))
