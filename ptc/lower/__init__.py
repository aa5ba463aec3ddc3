"""Lowering: the compile driver above the passes.

`ptc.lower.driver` captures a model, resolves the plan into one Decisions
record, runs the pass list through the generic runner and packages the
lowered stage graphs as a Program. It is the only room that imports both
the compiler and the passes; the runtime receives its Programs.
`ptc.lower.preflight` checks, before any process starts, what a run of a
plan needs (files, folders, factory, memory, a custom model's compile).
"""
