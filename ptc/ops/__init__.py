"""The graph ops the passes insert and the runtime executes.

Autograd-aware collectives over the mesh axes (`comm`), Megatron's tensor
parallel ops (`tp_ops`), ZeRO-3's parameter gather (`collectives`, with its
per-micro-batch session in `zero3`), activation-recompute regions
(`recompute`) and sequence-parallel regathering (`seq_regather`). Each op's
docstring states its backward. This room sits below both the passes, which
put these ops into graphs as call targets, and the runtime, which runs them.
"""
