"""Score ptc's cost model on published mixture-of-experts runs: Megatron-Bridge's MoE rows.

`bench/validate_out_of_sample.py` scores Megatron-Bridge's dense Llama rows; this
script scores the mixture-of-experts rows of the same pages (docs/performance-summary.md
and docs/performance-summary-archive.md of NVIDIA-NeMo/Megatron-Bridge as of commit
067f987df03b: the "Pre-Training Performance" tables of NeMo containers 26.08 back to
26.02), tokens per second per GPU. None of these runs set anything in ptc: the presets'
shares are solved from ../shared/validation, and nothing here is fitted.

The pages say every MoE benchmark forces a balanced routing and drops no token: ptc's
cost model prices an even routing, dropless, so the two agree by construction.

Each row is built by the same rules:
- the model is its transformers config as its model card publishes it (Qwen/Qwen3-30B-A3B,
  Qwen/Qwen3-235B-A22B, openai/gpt-oss-120b, deepseek-ai/DeepSeek-V3), built by
  `ptc.models.transformers_config.from_config` as `ptc.compile` builds a transformers
  model; it is profiled from a two-layer instance of that config and priced at the
  model's layer count (ptc prices every layer as its first, so the profile of one layer
  is all it reads);
- EP -> `parallel.ep` (folded from the data-parallel ranks, as Megatron-Core's parallel
  folding does); TP > 1 -> tp with sequence parallelism (Megatron requires it for MoE
  under tp); CP -> cp; FSDP > 0 -> ZeRO-3, else the distributed optimizer (ZeRO-1);
  the 26.06 and later tables give no FSDP column: read as 0, as every earlier table
  gives these layouts;
- VP > 1 -> interleaved 1F1B with VP stages per rank, else 1F1B; the pipeline cut is
  Megatron's even split where pp · vp divides the layers, else the split that counts the
  embedding and the loss as a layer each (Qwen3-235B's 94 layers: the first and the last
  stage hold (94 + 2) / pp - 1);
- precision: BF16 -> bf16; FP8 -> fp8 tensorwise; MXFP8 -> `fp8_recipe = mxfp8` (current
  scaling); communication overlapped and fused memory-bound kernels (`runtime.compile`),
  as the dense script's rows; runs of more than 72 GPUs on GB200/GB300 use 64 GPUs of
  each NVL72 rack.
Not expressible, each with its reason: DeepSeek-V3 (dense first layers before MoE ones:
ptc prices every layer as its first), Kimi-K2 (the Muon
optimizer) and what ptc does not price (sequence parallelism with MoE blocks).

It prints each row, then the median, p90 and max |error|, the rows within 10 % and 25 %,
and the ordering of pairs of rows of one model on one system (as the dense script).

Usage: python bench/validate_moe.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ptc.compiler.profile.cache import with_model_shape  # noqa: E402
from ptc.compiler.search.estimate import estimate  # noqa: E402
from ptc.compiler.shapes import even_cut, hardware_for  # noqa: E402
from ptc.errors import PtcError  # noqa: E402
from ptc.plan import (ModelSpec, OptimizerSpec, ParallelSpec, Plan, RuntimeSpec,  # noqa: E402
                      TrainSpec)
from validate_cost_model import error_summary  # noqa: E402
from validate_out_of_sample import RECIPES, pair_order  # noqa: E402

SEQ = 4096
"""Every MoE row of the summary trains at sequence length 4096."""

CONFIGS = {
    "Qwen3-30B-A3B": (48, dict(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960)),
    "Qwen3-235B-A22B": (94, dict(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, moe_intermediate_size=1536, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960)),
    "GPT-OSS-120B": (36, dict(
        architecture="GptOssForCausalLM", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
        tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=131072)),
    "DeepSeek-V3": (61, dict(
        architecture="DeepseekV3ForCausalLM", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
        num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=1,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, tie_word_embeddings=False, max_position_embeddings=163840)),
}
"""Model -> (layers, its transformers config but the layer count). DeepSeek-V3's first three
layers are dense; its two-layer instance keeps one dense layer before a MoE one."""

NOT_EXPRESSIBLE = {"Kimi-K2": "trained with the Muon optimizer, which ptc does not have"}

MODELS = {"DeepSeekV3": "DeepSeek-V3", "GPT OSS 120B": "GPT-OSS-120B", "Kimi_K2": "Kimi-K2",
          "Qwen3_30B_a3B": "Qwen3-30B-A3B", "Qwen3_235B_a22B": "Qwen3-235B-A22B"}
"""The summary's model names -> ours."""

SYSTEMS = {"DGX-H100": "H100-SXM", "DGX-B200": "B200", "DGX-GB200": "GB200",
           "DGX-GB300": "GB300", "DGX-B300": "B300"}
"""The summary's systems -> ptc's hardware presets."""

RUNS = """
26.08    | DeepSeekV3      | DGX-GB300 | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 2  | 1 | 8   | 32 | 6288
26.08    | DeepSeekV3      | DGX-GB200 | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 4  | 1 | 4   | 64 | 4912
26.08    | GPT OSS 120B    | DGX-GB300 | 64  | MXFP8 | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 16 | 33024
26.08    | GPT OSS 120B    | DGX-GB200 | 64  | MXFP8 | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 28672
26.08    | Qwen3_30B_a3B   | DGX-GB300 | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 44544
26.08    | Qwen3_30B_a3B   | DGX-GB200 | 8   | MXFP8 | 512   | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 39936
26.08    | Qwen3_235B_a22B | DGX-GB300 | 256 | MXFP8 | 8192  | 2 | 0 | 1 | 4  | 1 | 12  | 32 | 8816
26.08    | Qwen3_235B_a22B | DGX-GB200 | 256 | MXFP8 | 8192  | 1 | 0 | 1 | 8  | 1 | 3   | 32 | 7280
26.06.01 | DeepSeekV3      | DGX-GB300 | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 2  | 1 | 8   | 32 | 6304
26.06.01 | DeepSeekV3      | DGX-GB200 | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 4  | 1 | 4   | 64 | 4928
26.06.01 | GPT OSS 120B    | DGX-GB300 | 64  | MXFP8 | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 16 | 20288
26.06.01 | GPT OSS 120B    | DGX-GB200 | 64  | MXFP8 | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 18304
26.06.01 | Qwen3_30B_a3B   | DGX-GB300 | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 44544
26.06.01 | Qwen3_30B_a3B   | DGX-GB200 | 8   | MXFP8 | 512   | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 40960
26.06.01 | Qwen3_235B_a22B | DGX-GB300 | 256 | MXFP8 | 8192  | 2 | 0 | 1 | 4  | 1 | 12  | 32 | 9008
26.06.01 | Qwen3_235B_a22B | DGX-GB200 | 256 | MXFP8 | 8192  | 1 | 0 | 1 | 8  | 1 | 3   | 32 | 7360
26.06    | DeepSeekV3      | DGX-GB300 | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 2  | 1 | 8   | 32 | 6338
26.06    | DeepSeekV3      | DGX-GB300 | 256 | MXFP8 | 15360 | 1 | 0 | 1 | 2  | 1 | 8   | 32 | 6422
26.06    | DeepSeekV3      | DGX-GB200 | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 4  | 1 | 4   | 64 | 4969
26.06    | DeepSeekV3      | DGX-B300  | 256 | MXFP8 | 4096  | 2 | 0 | 1 | 8  | 1 | n/a | 8  | 3541
26.06    | GPT OSS 120B    | DGX-GB300 | 64  | MXFP8 | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 16 | 33166
26.06    | GPT OSS 120B    | DGX-GB200 | 64  | MXFP8 | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 28947
26.06    | GPT OSS 120B    | DGX-B300  | 64  | MXFP8 | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 18534
26.06    | Qwen3_30B_a3B   | DGX-GB300 | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 45275
26.06    | Qwen3_30B_a3B   | DGX-GB200 | 8   | MXFP8 | 512   | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 40706
26.06    | Qwen3_30B_a3B   | DGX-B300  | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 40769
26.06    | Qwen3_30B_a3B   | DGX-H100  | 16  | FP8   | 1024  | 1 | 0 | 1 | 1  | 1 | n/a | 16 | 8826
26.06    | Qwen3_235B_a22B | DGX-GB300 | 256 | MXFP8 | 8192  | 2 | 0 | 1 | 4  | 1 | 12  | 32 | 9015
26.06    | Qwen3_235B_a22B | DGX-GB200 | 256 | MXFP8 | 8192  | 1 | 0 | 1 | 8  | 1 | 3   | 32 | 7376
26.06    | Kimi_K2         | DGX-GB300 | 256 | MXFP8 | 4096  | 2 | 0 | 1 | 4  | 1 | 4   | 64 | 5372
26.04.01 | DeepSeekV3      | DGX-GB300 | 256 | MXFP8 | 4096  | 2 | 0 | 1 | 2  | 1 | 8   | 32 | 4992
26.04.01 | DeepSeekV3      | DGX-GB200 | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 4  | 1 | 4   | 64 | 4256
26.04.01 | DeepSeekV3      | DGX-B300  | 256 | MXFP8 | 4096  | 2 | 0 | 1 | 8  | 1 | n/a | 8  | 3456
26.04.01 | DeepSeekV3      | DGX-B200  | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 8  | 1 | 2   | 32 | 3328
26.04.01 | GPT OSS 120B    | DGX-GB300 | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 19200
26.04.01 | GPT OSS 120B    | DGX-GB200 | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 16640
26.04.01 | GPT OSS 120B    | DGX-B300  | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 15232
26.04.01 | GPT OSS 120B    | DGX-B200  | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 13568
26.04.01 | GPT OSS 120B    | DGX-H100  | 64  | BF16  | 1280  | 1 | 0 | 1 | 4  | 1 | n/a | 8  | 5824
26.04.01 | Qwen3_30B_a3B   | DGX-GB300 | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 31744
26.04.01 | Qwen3_30B_a3B   | DGX-GB200 | 8   | MXFP8 | 512   | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 26112
26.04.01 | Qwen3_30B_a3B   | DGX-B300  | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 30720
26.04.01 | Qwen3_30B_a3B   | DGX-B200  | 8   | MXFP8 | 512   | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 27136
26.04.01 | Qwen3_30B_a3B   | DGX-H100  | 16  | FP8   | 1024  | 1 | 0 | 1 | 1  | 1 | n/a | 16 | 8960
26.04.01 | Qwen3_235B_a22B | DGX-GB300 | 256 | MXFP8 | 8192  | 2 | 0 | 1 | 4  | 1 | 12  | 32 | 6944
26.04.01 | Qwen3_235B_a22B | DGX-GB200 | 256 | MXFP8 | 8192  | 1 | 0 | 1 | 8  | 1 | 3   | 32 | 5680
26.04.01 | Qwen3_235B_a22B | DGX-B300  | 256 | MXFP8 | 8192  | 2 | 0 | 1 | 8  | 1 | n/a | 8  | 5936
26.04.01 | Qwen3_235B_a22B | DGX-B200  | 256 | MXFP8 | 8192  | 1 | 0 | 1 | 8  | 1 | n/a | 8  | 3776
26.04.01 | Qwen3_235B_a22B | DGX-H100  | 256 | FP8   | 8192  | 1 | 0 | 2 | 8  | 1 | 4   | 32 | 1712
26.04.01 | Kimi_K2         | DGX-GB300 | 256 | MXFP8 | 4096  | 2 | 0 | 1 | 4  | 1 | 4   | 64 | 5328
26.04    | DeepSeekV3      | DGX-GB300 | 256 | MXFP8 | 4096  | 2 | 0 | 1 | 2  | 1 | 8   | 32 | 4965
26.04    | DeepSeekV3      | DGX-GB200 | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 4  | 1 | 4   | 64 | 4193
26.04    | DeepSeekV3      | DGX-B300  | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 16 | 1 | n/a | 8  | 3131
26.04    | DeepSeekV3      | DGX-B200  | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 16 | 1 | n/a | 8  | 2815
26.04    | GPT OSS 120B    | DGX-GB300 | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 19275
26.04    | GPT OSS 120B    | DGX-GB200 | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 15938
26.04    | GPT OSS 120B    | DGX-B300  | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 15114
26.04    | GPT OSS 120B    | DGX-B200  | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 13045
26.04    | GPT OSS 120B    | DGX-H100  | 64  | BF16  | 1280  | 1 | 0 | 1 | 4  | 1 | n/a | 8  | 5810
26.04    | Qwen3_30B_a3B   | DGX-GB300 | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 31470
26.04    | Qwen3_30B_a3B   | DGX-GB200 | 8   | MXFP8 | 512   | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 26032
26.04    | Qwen3_30B_a3B   | DGX-B300  | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 30553
26.04    | Qwen3_30B_a3B   | DGX-B200  | 8   | MXFP8 | 512   | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 26859
26.04    | Qwen3_30B_a3B   | DGX-H100  | 16  | FP8   | 1024  | 1 | 0 | 1 | 1  | 1 | n/a | 16 | 8901
26.04    | Qwen3_235B_a22B | DGX-GB300 | 256 | MXFP8 | 8192  | 2 | 0 | 1 | 4  | 1 | 12  | 32 | 6994
26.04    | Qwen3_235B_a22B | DGX-GB200 | 256 | MXFP8 | 8192  | 1 | 0 | 1 | 8  | 1 | 3   | 32 | 5672
26.04    | Qwen3_235B_a22B | DGX-B300  | 256 | MXFP8 | 8192  | 2 | 0 | 1 | 8  | 1 | n/a | 8  | 4865
26.04    | Qwen3_235B_a22B | DGX-H100  | 256 | FP8   | 8192  | 1 | 0 | 2 | 8  | 1 | 4   | 32 | 1686
26.04    | Kimi_K2         | DGX-GB300 | 256 | MXFP8 | 4096  | 2 | 0 | 1 | 4  | 1 | 4   | 64 | 5332
26.02.01 | DeepSeekV3      | DGX-GB300 | 256 | MXFP8 | 4096  | 2 | 0 | 1 | 2  | 1 | 8   | 32 | 4691
26.02.01 | DeepSeekV3      | DGX-GB200 | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 4  | 1 | 4   | 64 | 4021
26.02.01 | DeepSeekV3      | DGX-B300  | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 16 | 1 | n/a | 8  | 3099
26.02.01 | DeepSeekV3      | DGX-B200  | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 16 | 1 | n/a | 8  | 2790
26.02.01 | GPT OSS 120B    | DGX-GB300 | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 19366
26.02.01 | GPT OSS 120B    | DGX-GB200 | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 15754
26.02.01 | GPT OSS 120B    | DGX-B300  | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 15031
26.02.01 | GPT OSS 120B    | DGX-B200  | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 13722
26.02.01 | GPT OSS 120B    | DGX-H100  | 64  | BF16  | 1280  | 1 | 0 | 1 | 4  | 1 | n/a | 8  | 5984
26.02.01 | Qwen3_30B_a3B   | DGX-GB300 | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 30411
26.02.01 | Qwen3_30B_a3B   | DGX-GB200 | 8   | MXFP8 | 512   | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 26373
26.02.01 | Qwen3_30B_a3B   | DGX-B300  | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 29454
26.02.01 | Qwen3_30B_a3B   | DGX-B200  | 8   | MXFP8 | 512   | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 26695
26.02.01 | Qwen3_30B_a3B   | DGX-H100  | 16  | FP8   | 1024  | 1 | 0 | 1 | 2  | 1 | 12  | 8  | 9058
26.02.01 | Qwen3_235B_a22B | DGX-GB300 | 256 | MXFP8 | 8192  | 2 | 0 | 1 | 4  | 1 | n/a | 32 | 6583
26.02.01 | Qwen3_235B_a22B | DGX-GB200 | 256 | MXFP8 | 8192  | 1 | 0 | 1 | 8  | 1 | n/a | 32 | 5530
26.02.01 | Qwen3_235B_a22B | DGX-B300  | 256 | MXFP8 | 8192  | 1 | 0 | 1 | 8  | 1 | 4   | 8  | 2644
26.02.01 | Qwen3_235B_a22B | DGX-H100  | 256 | FP8   | 8192  | 1 | 0 | 2 | 8  | 1 | 4   | 32 | 1611
26.02.01 | Kimi_K2         | DGX-GB300 | 256 | MXFP8 | 4096  | 2 | 0 | 1 | 4  | 1 | 4   | 64 | 5072
26.02    | DeepSeekV3      | DGX-GB300 | 256 | MXFP8 | 4096  | 2 | 0 | 1 | 2  | 1 | 8   | 32 | 4612
26.02    | DeepSeekV3      | DGX-GB200 | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 4  | 1 | 4   | 64 | 3955
26.02    | DeepSeekV3      | DGX-B300  | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 16 | 1 | n/a | 8  | 2983
26.02    | DeepSeekV3      | DGX-B200  | 256 | MXFP8 | 4096  | 1 | 0 | 1 | 16 | 1 | n/a | 8  | 2689
26.02    | GPT OSS 120B    | DGX-GB300 | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 19412
26.02    | GPT OSS 120B    | DGX-GB200 | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 15784
26.02    | GPT OSS 120B    | DGX-B300  | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 8359
26.02    | GPT OSS 120B    | DGX-B200  | 64  | BF16  | 1280  | 4 | 0 | 1 | 1  | 1 | n/a | 64 | 8047
26.02    | GPT OSS 120B    | DGX-H100  | 64  | BF16  | 1280  | 1 | 0 | 1 | 4  | 1 | n/a | 8  | 5993
26.02    | Qwen3_30B_a3B   | DGX-GB300 | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 30376
26.02    | Qwen3_30B_a3B   | DGX-GB200 | 8   | MXFP8 | 512   | 4 | 0 | 1 | 1  | 1 | n/a | 8  | 26084
26.02    | Qwen3_30B_a3B   | DGX-B300  | 8   | MXFP8 | 512   | 8 | 0 | 1 | 1  | 1 | n/a | 8  | 29521
26.02    | Qwen3_30B_a3B   | DGX-B200  | 8   | MXFP8 | 512   | 1 | 0 | 1 | 1  | 1 | n/a | 8  | 9691
26.02    | Qwen3_30B_a3B   | DGX-H100  | 16  | FP8   | 1024  | 1 | 0 | 1 | 2  | 1 | 12  | 8  | 5113
26.02    | Qwen3_235B_a22B | DGX-GB300 | 256 | MXFP8 | 8192  | 2 | 0 | 1 | 4  | 1 | n/a | 32 | 6583
26.02    | Qwen3_235B_a22B | DGX-GB200 | 256 | MXFP8 | 8192  | 1 | 0 | 1 | 8  | 1 | n/a | 32 | 5448
26.02    | Qwen3_235B_a22B | DGX-B300  | 256 | MXFP8 | 8192  | 1 | 0 | 1 | 8  | 1 | 4   | 8  | 2691
26.02    | Qwen3_235B_a22B | DGX-B200  | 256 | MXFP8 | 8192  | 1 | 0 | 1 | 8  | 1 | n/a | 8  | 3805
26.02    | Qwen3_235B_a22B | DGX-H100  | 256 | FP8   | 8192  | 1 | 0 | 2 | 8  | 1 | 4   | 32 | 1633
"""
"""The summary's MoE pre-training rows, transcribed: container | model | system | GPUs |
precision | GBS | MBS | FSDP | TP | PP | CP | VP | EP | tokens/s/GPU (26.06 on: no FSDP
column, 0)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One published run."""

    container: str
    model: str
    system: str
    gpus: int
    precision: str
    gbs: int
    mbs: int
    fsdp: int
    tp: int
    pp: int
    cp: int
    vp: int
    ep: int
    measured: float

    @property
    def layout(self) -> str:
        """The row's layout in one short string."""
        return (f"{'fsdp ' if self.fsdp else ''}tp{self.tp} pp{self.pp} vp{self.vp} "
                f"ep{self.ep} b{self.mbs}")


def rows() -> list[Row]:
    """RUNS parsed."""
    out = []
    for line in RUNS.strip().splitlines():
        c, m, sysname, gpus, prec, gbs, mbs, fsdp, tp, pp, cp, vp, ep, tok = \
            [x.strip() for x in line.split("|")]
        out.append(Row(c, MODELS[m], sysname, int(gpus), prec, int(gbs), int(mbs), int(fsdp),
                       int(tp), int(pp), int(cp), 1 if vp == "n/a" else int(vp), int(ep),
                       float(tok)))
    return out


def build(row: Row) -> Plan:
    """The Plan of one row, by the module docstring's rules (PtcError where it cannot be
    expressed)."""
    if row.model in NOT_EXPRESSIBLE:
        raise PtcError(NOT_EXPRESSIBLE[row.model])
    layers, config = CONFIGS[row.model]
    model = ModelSpec(family="custom", factory="ptc.models.transformers_config:from_config",
                      kwargs={**config, "num_hidden_layers": 2})
    rack = 64 if row.system.startswith("DGX-GB") and row.gpus > 72 else None
    hardware = hardware_for(SYSTEMS[row.system], row.gpus, rack)
    dp = row.gpus // (row.tp * row.pp * row.cp)
    cut = even_cut(layers, row.pp) if layers % (row.pp * row.vp) == 0 else {
        "first_stage_layers": (layers + 2) // row.pp - 1,
        "last_stage_layers": (layers + 2) // row.pp - 1}
    parallel = ParallelSpec(
        tp=row.tp, pp=row.pp, dp=dp, cp=row.cp, ep=row.ep, zero=3 if row.fsdp else 1,
        sequence_parallel=row.tp > 1, schedule="interleaved" if row.vp > 1 else "1f1b",
        virtual_stages=row.vp, checkpoint="none", overlap=True, **cut)
    fp8 = row.precision != "BF16"
    train = TrainSpec(seq_len=SEQ, global_batch=row.gbs, micro_batch=row.mbs,
                      dtype="fp8" if fp8 else "bf16", optimizer=OptimizerSpec(name="adamw"),
                      **({"fp8_recipe": RECIPES[row.precision], "fp8_scaling": "current"}
                         if fp8 else {}))
    plan = with_model_shape(Plan(model=model, hardware=hardware, parallel=parallel,
                                 train=train, runtime=RuntimeSpec(compile=True)))
    return dataclasses.replace(plan, model=dataclasses.replace(plan.model, layers=layers))


def main() -> int:
    """Print each row's predicted and measured tokens/s per GPU, then the error summary and
    how well ptc orders the rows of one model on one system."""
    print(f"{'ngc':<9}{'model':<16}{'system':<10}{'gpus':>5}  {'layout':<28}{'prec':<6}"
          f"{'pred':>7}{'meas':>7}{'err':>8}  step parts")
    runs = rows()
    errors, ranked = [], []
    for row in runs:
        head = (f"{row.container:<9}{row.model:<16}{row.system[4:]:<10}{row.gpus:>5}  "
                f"{row.layout:<28}{row.precision:<6}")
        try:
            plan = build(row)
            est = estimate(plan)
        except PtcError as exc:
            print(f"{head}not expressible: {str(exc).splitlines()[0][:110]}")
            continue
        predicted = row.gbs * SEQ / est.step_time_s / row.gpus
        error = (predicted - row.measured) / row.measured
        errors.append(error)
        ranked.append(((row.model, row.system), plan, predicted, row.measured))
        parts = ", ".join(f"{k} {v / est.step_time_s:.0%}"
                          for k, v in est.breakdown.items() if v >= 0.005 * est.step_time_s)
        print(f"{head}{predicted:>7.0f}{row.measured:>7.0f}{error:>+8.1%}  {parts}")
    print(f"\n{len(errors)} of {len(runs)} runs expressible; {error_summary(errors)}")
    print(f"ordering (same model and system): {pair_order(ranked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
