"""Per-shape profiles of a model, one module per job: the profile types, the cache, the
capture of one layer, its regions, what is measured there, the tp/sp byte classes, fp8
copies, and the polynomial fits (see `ptc.compiler.profile.types` for the terms)."""
