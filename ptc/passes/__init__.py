"""Graph passes, and the ordered list the compile pipeline runs.

Each pass is `<verb>_<noun>_pass(gm, plan, *, knobs) -> GraphModule`
(DESIGN convention 1); `ptc.lower.driver.run_passes` runs them in the
order below. A pass that does not apply to a plan returns the graph
unchanged.
"""

from ptc.passes.activation_checkpoint import checkpoint_layers_pass
from ptc.passes.comm_overlap import overlap_collectives_pass
from ptc.passes.pipeline_split import split_pipeline_pass
from ptc.passes.sequence_parallel import shard_sequence_pass
from ptc.passes.tensor_parallel import shard_tensors_pass
from ptc.passes.zero import shard_params_pass

PASSES = (shard_tensors_pass, shard_sequence_pass, split_pipeline_pass, checkpoint_layers_pass,
          shard_params_pass, overlap_collectives_pass)
"""The pipeline, in order: tensor_parallel, sequence_parallel, pipeline_split,
activation_checkpoint, zero, comm_overlap. activation_checkpoint runs before zero so
zero sees the parameters its regions read; comm_overlap runs last, on every collective."""

__all__ = ["PASSES", "checkpoint_layers_pass", "overlap_collectives_pass", "shard_params_pass",
           "shard_sequence_pass",
           "shard_tensors_pass", "split_pipeline_pass"]
