"""Context parallelism on gloo processes trains exactly like single-process PyTorch.

Layouts: cp = 2 alone, cp 2 × tp 2 (with and without sequence parallelism),
cp 2 × pp 2 (1F1B), cp 2 × dp 2 with ZeRO-1 and ZeRO-3. Models: the built-in
GPT (attention written out: scores, causal masked_fill, softmax; learned
positions, tied embeddings), Llama (F.scaled_dot_product_attention with
grouped-query heads, RoPE tables sliced by the sequence length) and the
nanoGPT user model (sizes read off tensors); GPT and nanoGPT also with
dropout 0.1 on the attention probabilities, residual and embedding, whose
masks are each sample's own whatever part of the sequence a rank holds
(`ptc.ops.dropout`, drawn the same way by the eager run).

The loss of every step and every parameter after 5 AdamW steps (cosine
schedule with warm-up, global-norm clipping at 1.0) equal `torch.optim.AdamW`
on the eager model over the full global batch, from the same initial
weights on the same samples. Tolerances: derived per case by
`tests/tolerances.py` from the same eager training in float64 (fp32) or
from the fp32 and fp64 runs' spread scaled to bf16 (bf16 plans).
Hugging Face Llama, GPT-2 and Qwen2 (ZeRO-1) under cp 2 are checked the same way.
So is Mixtral trained on its loss plus its routers' load-balancing loss over the
micro-batch (one per step here, as the eager run's batch): each rank's counts and sums
over its tokens are summed over cp (`context_reduce`), forward and backward.
"""

from __future__ import annotations

import pytest
from cp_helpers import CPCase, cp_plan, run_cp_cases
from dist_helpers import STEPS, assert_same_training, reference
from hf_helpers import HFCase, hf_module, hf_plan, run_hf_cases

from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

LAUNCHES = {
    "cp2": [CPCase("gpt"), CPCase("llama"), CPCase("nanogpt"), CPCase("gpt+dropout"),
            CPCase("nanogpt+dropout"), CPCase("llama", dtype="bf16"),
            CPCase("mixtral+router_loss")],
    "cp2x2": [CPCase("llama", tp=2), CPCase("gpt", tp=2, sp=True),
              CPCase("gpt+dropout", tp=2, sp=True),
              CPCase("llama", pp=2), CPCase("gpt", pp=2),
              CPCase("gpt", dp=2, zero=1), CPCase("llama", dp=2, zero=3),
              CPCase("gpt+dropout", dp=2, zero=3)],
}
CASES = [(launch, case) for launch, cases in LAUNCHES.items() for case in cases]
_runs: dict[str, dict] = {}


def _run(launch: str) -> dict:
    if launch not in _runs:
        cases = LAUNCHES[launch]
        _runs[launch] = run_local(run_cp_cases, cases[0].world, cases)[0]
    return _runs[launch]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launch,case", CASES, ids=[f"{c}" for _, c in CASES])
def test_matches_single_process_adamw(launch: str, case: CPCase) -> None:
    got = _run(launch)[case]
    assert len(got["losses"]) == STEPS
    assert got["log"][0].startswith("split_context_pass: folded")
    assert_same_training(got, reference(cp_plan(case)), what=str(case))


HF_CASES = [HFCase("llama", cp=2), HFCase("gpt2", cp=2), HFCase("qwen2", cp=2, zero=1)]
"""Hugging Face models (export door): the causal mask they build from their position ids is
recognised by evaluating it; RoPE tables (llama, qwen2) and learned positions (gpt2) enter
the split sequence through context_chunks."""
_hf: dict = {}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", HF_CASES, ids=[str(c) for c in HF_CASES])
def test_hugging_face_models_match_single_process_adamw(case: HFCase) -> None:
    if not _hf:
        _hf.update(run_local(run_hf_cases, 2, HF_CASES)[0])
    got = _hf[case]
    assert got["log"][0].startswith("split_context_pass: folded")
    assert "2 context_attention" in got["log"][0]
    assert_same_training(got, reference(hf_plan(case), hf_module(case)), what=str(case))
