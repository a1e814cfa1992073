"""The run directory: lock, checkpoints, resume, disk errors."""
