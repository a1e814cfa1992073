"""packtrain: shared-prefix packed LoRA fine-tuning for long-context Qwen3.5/3.6 hybrid models."""

__version__ = "0.1.0"
