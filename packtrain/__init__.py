"""packtrain: shared-prefix packed LoRA fine-tuning for long-context Qwen3.5/3.6 hybrid models."""

__version__ = "0.1.0"


def use_torch_kernels_on_cpu() -> None:
    """Make transformers' Qwen3.5 / Qwen3.6 / Qwen3-Next layers run their pure-torch Gated DeltaNet kernels on CPU
    tensors, for a plain transformers (+ peft) forward or ``generate`` outside packtrain.

    Needed only on a machine with fla installed and no GPU (the venv ``make`` builds: fla is there for the tests'
    interpreter runs): transformers then calls fla's Triton kernels on CPU tensors, which fail with "0 active
    drivers". Called before the model is loaded (as in the README), it also spares the process importing fla.
    CUDA tensors keep transformers' own choice. Idempotent; packtrain's own commands do this themselves.
    """
    from packtrain.packed.kernels.hf_route import route_unpacked_kernels

    route_unpacked_kernels()
