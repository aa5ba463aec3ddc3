"""Mixtures of experts train under expert parallelism exactly as in eager PyTorch.

`parallel.ep` shards each MoE layer's routed experts over ep ranks folded
from dp·cp (`ptc.passes.shard_experts`): the rows the router sends to an expert
travel to the rank holding it by an all-to-all of uneven splits and come
back after its GEMMs. Routing itself — softmax top-2 (Mixtral, Qwen3-MoE),
sigmoid grouped top-k with a correction bias beside a shared expert and a
dense first layer (DeepSeek-V3), a router with a bias and per-expert biases
gathered per row (GPT-OSS), a shared expert behind its own sigmoid gate
(Qwen2-MoE), a sparse mixer (PhiMoE) — runs unchanged on each rank's own
tokens.

Each case is compared with single-process eager training of the same module
from the same weights on the same samples: the loss of every step and every
parameter after 5 AdamW steps, within the bounds `tests/tolerances.py`
derives from the same run in float64 (bf16: from that recipe's own distance
to fp64). Covered: ep 2 and 4 at dp 4 (ZeRO 0-3: each expert's gradient
averaged, and its shards gathered, over the ranks that hold it), ep × tp (the
stacks split by both; with sequence parallelism too; DeepSeek-V3's latent attention
split by heads), ep × pp (1F1B and zero bubble, whose split backward
runs the dispatch's gradient in I), ep × cp (ep folded from the cp ranks, and from
dp·cp), full and selective recompute (the dispatch
recomputed with its layer), bf16, attention dropout, a top-1 router, and routers frozen at zero
so that every token goes to experts 0 and 1 and the ranks holding the others
receive nothing. The bytes each rank holds equal `Program.state_bytes`. All
cases run in one launch of 4 gloo processes.
"""

from __future__ import annotations

import pytest
from dist_helpers import assert_same_training, reference
from hf_helpers import HFCase, hf_module, hf_plan, run_hf_cases

from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

CASES = [
    HFCase("mixtral", dp=4, ep=4), HFCase("mixtral", dp=4, ep=2, zero=1),
    HFCase("qwen3_moe", dp=4, ep=2, zero=2), HFCase("deepseek_v3", dp=4, ep=4),
    HFCase("gpt_oss", dp=4, ep=2), HFCase("mixtral", dp=4, ep=2, zero=3),
    HFCase("deepseek_v3", dp=4, ep=4, zero=3),
    HFCase("mixtral", dp=4, ep=2, checkpoint="full"),
    HFCase("qwen3_moe", dp=4, ep=4, checkpoint="selective"),
    HFCase("mixtral", tp=2, dp=2, ep=2), HFCase("mixtral", pp=2, dp=2, ep=2),
    HFCase("deepseek_v3", tp=2, dp=2, ep=2),
    HFCase("qwen2_moe", tp=2, dp=2, ep=2, sp=True, zero=1),
    HFCase("mixtral", pp=2, dp=2, ep=2, schedule="zero_bubble"),
    HFCase("qwen2_moe", dp=4, ep=2), HFCase("phimoe", dp=4, ep=2),
    HFCase("mixtral", dp=4, ep=4, dtype="bf16"), HFCase("qwen3_moe", dp=4, ep=2, dtype="bf16"),
    HFCase("mixtral", dp=4, ep=2, config=(("attention_dropout", 0.1),)),
    # a top-1 router; a router that sends every token to experts 0 and 1 (ranks 2 and 3 of
    # ep 4, and rank 1 of ep 2 at top-1, receive nothing)
    HFCase("mixtral", dp=4, ep=4, config=(("num_experts_per_tok", 1),)),
    HFCase("mixtral_one_sided", dp=4, ep=4),
    HFCase("mixtral_one_sided", dp=4, ep=2, config=(("num_experts_per_tok", 1),)),
    # with context parallelism: ep 2 folds the two cp ranks of each sample's chunks, ep 4
    # both samples' cp ranks
    HFCase("mixtral", dp=2, cp=2, ep=2), HFCase("mixtral", dp=2, cp=2, ep=4),
]
_runs: dict = {}


def _results() -> dict:
    if not _runs:
        _runs.update(run_local(run_hf_cases, 4, CASES)[0])
    return _runs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=[str(case) for case in CASES])
def test_trains_like_eager_pytorch(case: HFCase) -> None:
    got = _results()[case]
    assert any("ep_dispatch" in line for line in got["log"]), got["log"]
    assert_same_training(got, reference(hf_plan(case), hf_module(case)), what=str(case))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [c for c in CASES if c.pp == 1], ids=str)
def test_each_rank_holds_what_the_program_says(case: HFCase) -> None:
    """Expert units hold E/ep experts, sharded over the dp/ep ranks that share them."""
    got = _results()[case]
    assert got["held"] == got["predicted"]
