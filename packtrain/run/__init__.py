"""The training run: trainer, steps, the unit runner, eval, optimizer, metrics, stop policies."""
