"""Building, loading, wrapping and exporting models, and what a unit of them costs in FLOPs (:mod:`~packtrain.models.cost`);
what a step holds in memory is :mod:`packtrain.memory`'s."""
