"""Real Hugging Face `transformers` models train under ptc's layouts exactly as in eager PyTorch.

Tiny configs built in-process (tests/user_models/transformers_models): a Llama
(grouped-query attention, RoPE, SwiGLU, untied head; captured through the
export door, whose graph creates its causal mask and positions with device
literals) and GPT-2 (Conv1D projections, fused qkv, tied head, learned
positions); one Llama has a pad token, whose embedding row gets no gradient,
also when the table is vocabulary-parallel. The module given to
`ptc.compile` is what trains: the loss of
every step and every parameter after 5 AdamW steps equal eager training of
that module from the same weights on the same samples, within the bounds
`tests/tolerances.py` derives from the same run in float64. Their `labels`
argument is left None (the model would shift ptc's targets a second time);
the next-token loss is ptc's. All cases run on 2 gloo processes, in one
launch.

GPT-2's Conv1D layers cannot be split by tensor parallelism yet: that is a
CompileError naming each layer and the `shard` rule that keeps it whole.
"""

from __future__ import annotations

import pytest
from dist_helpers import assert_same_training, reference
from hf_helpers import HFCase, hf_module, hf_plan, run_hf_cases

from ptc.errors import CompileError
from ptc.lower.driver import compile_plan
from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

CASES = [
    HFCase("llama", dp=2, zero=1), HFCase("llama", dp=2, zero=3), HFCase("llama", tp=2),
    HFCase("llama", tp=2, sp=True, checkpoint="full"), HFCase("llama", pp=2),
    # a padding row (no gradient) in a vocabulary-parallel embedding
    HFCase("llama", tp=2, config=(("pad_token_id", 1),)),
    HFCase("gpt2", dp=2, zero=1), HFCase("gpt2", dp=2, zero=3), HFCase("gpt2", pp=2),
]
_runs: dict = {}


def _results() -> dict:
    if not _runs:
        _runs.update(run_local(run_hf_cases, 2, CASES)[0])
    return _runs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_trains_like_eager_pytorch(case: HFCase) -> None:
    got = _results()[case]
    assert_same_training(got, reference(hf_plan(case), hf_module(case)), what=str(case))


def test_gpt2_conv1d_under_tp_is_refused_naming_the_layers_and_the_rule() -> None:
    case = HFCase("gpt2", tp=2)
    with pytest.raises(CompileError, match=r"linear 'transformer.h.0.mlp.c_fc' .*\n.*shard "
                                           r"\"transformer.h.\*.mlp.c_fc\" replicate"):
        compile_plan(hf_plan(case), model=hf_module(case))
