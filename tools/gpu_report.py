"""GPU report: one pack on a mid-size random hybrid model in bf16, fla+flex vs the torch reference and vs
standalone, with time and peak memory. Prints a table. Run by tools/gpu_check.sh.

Shape: hidden 1024, 8 layers (3 GDN : 1 attention), P 8192 tokens, 32 continuations of 256 (ratio ~ 25x).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from parity import packed_run, rel, standalone_run  # noqa: E402
from tiny_models import random_pack, tiny_text_config  # noqa: E402

from packtrain.packed.kernels import Backend  # noqa: E402
from packtrain.packed.patch import patch_model  # noqa: E402


def build(backend, dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    cfg = tiny_text_config(["linear_attention"] * 3 + ["full_attention"], vocab=4096, hidden_size=1024,
                           intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                           linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
                           linear_value_head_dim=64, num_hidden_layers=8,
                           layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    model = Qwen3_5ForCausalLM(cfg).to("cuda", dtype)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "in_proj_qkv", "out_proj"]))
    model.enable_input_require_grads()
    return patch_model(model, backend)


def timed(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t, torch.cuda.max_memory_allocated() / 2**30


def main():
    prefix, conts = random_pack(8192, [(200, 56)] * 32, vocab=4096, seed=0)
    rows = []
    fla_model = build(Backend("fla", "flex"), torch.bfloat16)
    packed_run(fla_model, prefix, conts[:2])  # compile / autotune outside the timing
    (fl, fg), t_fla, m_fla = timed(lambda: packed_run(fla_model, prefix, conts))
    rows.append(("packed fla+flex bf16", t_fla, m_fla, "-", "-"))
    (sl, sg), t_sa, m_sa = timed(lambda: standalone_run(fla_model, prefix, conts))
    lossd = rel(torch.tensor(fl, dtype=torch.float64), torch.tensor(sl, dtype=torch.float64))
    gradd = max(rel(fg[n].float(), sg[n].float()) for n in fg)
    rows.append(("standalone bf16 (same model)", t_sa, m_sa, f"{lossd:.2e}", f"{gradd:.2e}"))
    del fla_model
    ref_model = build(Backend("torch", "batched"), torch.float32)
    (rl, rg), t_ref, m_ref = timed(lambda: packed_run(ref_model, prefix, conts))
    lossd = rel(torch.tensor(fl, dtype=torch.float64), torch.tensor(rl, dtype=torch.float64))
    gradd = max(rel(fg[n].float(), rg[n].float()) for n in fg)
    rows.append(("packed torch reference fp32", t_ref, m_ref, f"{lossd:.2e}", f"{gradd:.2e}"))
    print(f"\n{'run':32s} {'seconds':>8s} {'peak GiB':>9s} {'loss rel diff':>14s} {'grad rel diff':>14s}")
    for name, t, m, ld, gd in rows:
        print(f"{name:32s} {t:8.2f} {m:9.2f} {ld:>14s} {gd:>14s}")
    print("(diffs are against the packed fla+flex bf16 run; speedup packed vs standalone "
          f"{t_sa / t_fla:.1f}x, position ratio {(len(prefix) + 256) * 32 / (len(prefix) + 256 * 32):.1f}x)")


if __name__ == "__main__":
    main()
