"""The compiler: capture, node metadata, predicates, FLOPs, memory and cost models,
plan search, and the Program.

Import what you need from its submodule (`ptc.compiler.capture.capture`,
`ptc.compiler.records.graph_meta.NodeInfo`, ...). Nothing is re-exported here, so that
importing a torch-free submodule (`ptc.compiler.cost.topology`) stays cheap and a
submodule is never shadowed by a function of the same name.
"""
