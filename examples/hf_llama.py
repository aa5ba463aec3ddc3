"""A tiny Hugging Face Llama for examples/hf_llama_tp2_pp2_dp2.ptc, and its starting weights.

    python examples/hf_llama.py save examples/weights/tiny-llama  # the seeded model
    ptc run examples/hf_llama_tp2_pp2_dp2.ptc    # trains it from those weights
    ptc export examples/ckpt/hf-llama --hf weights/tiny-llama-trained
    python examples/hf_llama.py show weights/tiny-llama-trained

The plan names `tiny_llama` as its factory (`model "examples.hf_llama:tiny_llama"`),
so run these from the repository root.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


def tiny_llama() -> LlamaForCausalLM:
    """4 layers, grouped-query attention (4 query heads over 2 key/value heads), 512 tokens."""
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0))


def main(argv: list[str]) -> None:
    """`save DIR`: write the seeded model; `show DIR`: load one and print its next tokens."""
    command, directory = argv
    if command == "save":
        torch.manual_seed(0)
        tiny_llama().save_pretrained(directory)
        print(f"saved to {directory}")
    elif command == "show":
        model = AutoModelForCausalLM.from_pretrained(directory)
        tokens = torch.arange(16).unsqueeze(0)
        with torch.no_grad():
            print("next tokens:", model(tokens).logits.argmax(-1).tolist())
    else:
        raise SystemExit(f"unknown command {command!r}: use save DIR or show DIR")


if __name__ == "__main__":
    main(sys.argv[1:])
