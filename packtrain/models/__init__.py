"""Building, loading, wrapping and exporting models, and the per-GPU memory estimate of a model's step
(:mod:`~packtrain.models.memory`, ``plan --memory``)."""
