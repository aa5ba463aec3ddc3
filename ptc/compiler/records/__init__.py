"""Pure record types of the compiler, at the bottom of its rooms: node and graph metadata,
layouts (parallel, tensor-parallel, parameter), stages, overlap plans, the Estimate, the
Decisions and the Program. They import only the schedule IR and the plan, so any room may
name them without an import cycle."""
