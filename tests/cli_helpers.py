"""Run the real `packtrain` CLI in a subprocess on tiny configs written to a temp directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

TINY_MODEL = {
    "model_type": "qwen3_5_text", "vocab_size": 1024, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
}

RULEBOOKS = [
    "Rulebook A. Map each colour word to its code: red is alpha, blue is beta, green is gamma. Answer with the code.",
    "Rulebook B. Map each colour word to its code: red is gamma, blue is alpha, green is beta. Answer with the code.",
    "Rulebook C. Answer with the colour word repeated twice, separated by a space.",
]


def write_text_data(path: Path, items_per_rulebook: int = 5, offset: int = 0) -> Path:
    words = ["red", "blue", "green", "red blue", "green red", "blue green", "blue"]
    lines = []
    for r, system in enumerate(RULEBOOKS):
        for i in range(items_per_rulebook):
            w = words[(i + offset + r) % len(words)]
            lines.append({"id": f"r{r}-{i + offset}", "system": system, "item": f"Colour: {w}",
                          "target": f"code for {w} under rulebook {'ABC'[r]}"})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def write_config(tmp: Path, name: str = "cfg.yaml", **sections) -> Path:
    cfg = {
        "model": {"config": TINY_MODEL, "seed": 0, "dtype": "float64", "kernels": "torch"},
        "data": {"train": str(write_text_data(tmp / "train.jsonl")),
                 "eval": str(write_text_data(tmp / "eval.jsonl", items_per_rulebook=2, offset=3))},
        "packing": {"mode": "shared_prefix", "token_budget": 160, "max_continuations": 3},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "init_lora_weights": False},
        "optim": {"name": "adamw", "lr": 1.0e-3, "warmup_steps": 0},
        "train": {"epochs": 1, "packs_per_step": 2, "seed": 0, "save_every": 100},
        "logging": {"progress": False},
        "output_dir": str(tmp / "run"),
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg[section].update(values)
        else:
            cfg[section] = values
    path = tmp / name
    path.write_text("# packtrain train " + name + "\n" + yaml.safe_dump(cfg))
    return path


def run_cli(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "packtrain", *args], capture_output=True, text=True, env=full_env,
                          cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"packtrain {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(nproc: int, *args: str, env: dict | None = None, check: bool = True,
                    timeout: int = 240) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N -m packtrain ...` on CPU (gloo), as `accelerate launch` would start it."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), "-m", "packtrain", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=REPO, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc


def write_model_dir(path: Path, seed: int = 0) -> Path:
    """A local model directory as `model.path` expects one: a tiny random Qwen3.5 text model (TINY_MODEL,
    `save_pretrained`) with the bundled tokenizer beside it."""
    import torch
    from transformers import AutoConfig, Qwen3_5ForCausalLM

    from packtrain.data.examples import load_tokenizer

    raw = dict(TINY_MODEL)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(seed)
    Qwen3_5ForCausalLM(config).save_pretrained(path)
    load_tokenizer().save_pretrained(path)
    return path


# SGD without clipping: a trained adapter is a plain function of the summed gradients, so two runs that should
# compute the same gradients can be compared through their adapters (AdamW's first step would amplify rounding).
SGD = {"name": "sgd", "lr": 0.5, "warmup_steps": 0, "max_grad_norm": None}


def adapter_of(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def train_losses(run_dir: Path) -> list:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("split") != "eval"]


def max_rel(a: dict, b: dict) -> float:
    """The largest over tensors of max|a - b| / max|b|."""
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)
