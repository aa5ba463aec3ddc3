"""The cost model: compute at the hardware's rates, collectives on the topology's links,
bucketed gradient traffic, the step's own synchronisation, and the step time of a layout."""
