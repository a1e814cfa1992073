import os

# Transformers' kernel-hub lookups and telemetry must never touch the network in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# fla's kernels run on CPU only under Triton's interpreter, and Triton reads this when fla is imported (with
# transformers' Qwen3.5 module), so it is set before any test module imports either; with CUDA the GPU tests run
# fla compiled. See packtrain/packed/kernels/interpreter.py and tests/test_fla_interpreter.py.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
