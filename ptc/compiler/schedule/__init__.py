"""The pipeline schedule IR, one module per job: actions and schedules, their generation,
their lowering to per-rank programs, and their simulation."""
