import os

# Transformers' kernel-hub lookups and telemetry must never touch the network in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
