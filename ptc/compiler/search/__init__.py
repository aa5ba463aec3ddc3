"""Layouts and what fits: the estimate of a plan (its pipeline cut balanced), the plan
search over every valid layout, and the memory fit solvers."""
