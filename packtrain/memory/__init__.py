"""What a training step holds in memory and what it may hold: the estimate, the count under fake tensors, the
budget, and the savings chosen to fit it."""
