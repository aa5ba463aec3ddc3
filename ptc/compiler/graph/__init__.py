"""Facts read off captured graphs: node metadata and predicates, FLOPs and work, masks,
tensor-parallel structure, saved activations, recompute regions, parameter units, stage
graphs and lazily generated graph code."""
