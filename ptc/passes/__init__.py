"""Graph passes, one file per pass family.

Each pass is `<verb>_<noun>_pass(gm, decisions, **knobs) -> GraphModule`
(DESIGN convention 1): it reads the plan's Decisions record, takes its knobs
as keyword-only parameters, changes the graph in place and logs what it
inserted. A pass that does not apply to a plan returns the graph unchanged.
The ordered list and the runner live above, in `ptc.lower`.
"""

from ptc.passes.cap_experts import cap_experts_pass
from ptc.passes.checkpoint_layers import checkpoint_layers_pass
from ptc.passes.overlap_collectives import overlap_collectives_pass
from ptc.passes.quantize_gemms import quantize_gemms_pass
from ptc.passes.shard_experts import shard_experts_pass
from ptc.passes.shard_params import shard_params_pass
from ptc.passes.shard_sequence import shard_sequence_pass
from ptc.passes.shard_tensors import shard_tensors_pass
from ptc.passes.split_context import split_context_pass
from ptc.passes.split_pipeline import split_pipeline_pass

__all__ = ["cap_experts_pass", "checkpoint_layers_pass", "overlap_collectives_pass", "quantize_gemms_pass",
           "shard_experts_pass", "shard_params_pass", "shard_sequence_pass", "shard_tensors_pass", "split_context_pass",
           "split_pipeline_pass"]
