"""The memory model: per-stage bytes as sympy expressions of the profile
(`ptc.compiler.memory.model`)."""
