"""The GPU bring-up's verdicts, each a measurement against a bound with PASS / FAIL (run by tools/gpu/check.py;
the bounds and their reasons: docs/operations.md, "First run on a GPU").

    python tools/gpu/verdicts.py NAME [NAME ...] [--tiny]   # NAME: see --list
    python tools/gpu/verdicts.py --list

Each verdict appends one JSON line to $OUT/verdicts.jsonl ($OUT: the environment's, default /tmp/gpu_check) the
moment it is decided and rewrites $OUT/verdicts.md, the table, so a run stopped at its time limit keeps every verdict decided before.
``--tiny`` runs small shapes, on CPU too where the verdict has a CPU form (the CI checks the code paths that way:
tests/test_gpu_check.py); the bounds are the same.

  versions   every dependency as imported (the wheels over the image's packages) inside the tested ranges
  flex       FlexAttention forward + backward at head_dim 256, GQA 24/4, on the seed's pack (P 64,000 + 80
             continuations), bf16, against the batched reference path: its error against float32 within 2x the
             reference path's own bf16 error (torch's FlexAttention tests bound a kernel the same way)
  gdn        fla's chunked Gated DeltaNet (cu_seqlens, per-sequence initial_state) in bf16 at K = V = 128 against
             the float32 torch reference: fla's own fp16 test bounds scaled by the bf16/fp16 unit roundoff (8x)
  gdn_kernel which delta-rule kernel fla ran (its Triton one, or FlashQLA), against the pinned one (decided by the
             gdn run: either name runs it)
  parity     a bf16 pack against the same examples alone (losses and LoRA gradients), Qwen3.6-27B's widths with 2
             layers (one GDN, one attention), on fla + FlexAttention: its gaps within 2x the torch back end's on the
             same model and pack (correct on CPU; a broken plumbing's gradient gap is 4x a correct one's,
             tests/mutations.py)
  memory     torch.cuda.max_memory_allocated per phase of the seed's pack step (27B widths, 2 layers) against
             `plan --memory --measure`: within 10%
  speed      positions/s and MFU of that step: MFU >= 0.20 of the bf16 dense peak
  offload    that step with the layer inputs offloaded against without: the same loss, a lower peak, at most 1.5x
             the time
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NAMES = ("versions", "flex", "gdn", "gdn_kernel", "parity", "memory", "speed", "offload")
# fla's tests/ops/test_gated_delta.py (fp16 against a float32 reference, RMSE ratio): o, ht 0.005; dq, dk, dv, dh0
# 0.008; dbeta, dg 0.02. bf16 keeps 8 significant bits where fp16 keeps 11: each bound times 2^3.
GDN_BOUNDS = {"o": 0.04, "ht": 0.04, "dq": 0.064, "dk": 0.064, "dv": 0.064, "dh0": 0.064, "dbeta": 0.16, "dg": 0.16}
FLEX_FACTOR = 2.0  # the kernel's bf16 error may be at most this many times the reference path's
PARITY_FACTOR = 2.0  # the fla pack's bf16 gaps to standalone at most this many times the torch back end's
MEMORY_TOLERANCE = 0.10
MFU_FLOOR = 0.20
OFFLOAD_TIME = 1.5
PEAK_TFLOPS = 989.0  # H100 / H200 bf16 dense, the datasheet figure (packtrain/bench/presets.py)


def out_dir() -> Path:
    out = Path(os.environ.get("OUT", "/tmp/gpu_check"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def record(name: str, passed: bool, measured: str, bound: str, detail: str = "") -> bool:
    """One verdict: a line of DIR/verdicts.jsonl, the table rewritten, a line printed."""
    line = {"verdict": name, "pass": bool(passed), "measured": measured, "bound": bound, "detail": detail}
    out = out_dir()
    with (out / "verdicts.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")
    write_table(out)
    print(f"{'PASS' if passed else 'FAIL'}  {name}: {measured} (bound: {bound}){' - ' + detail if detail else ''}",
          flush=True)
    return bool(passed)


def write_table(out: Path) -> None:
    """verdicts.md from verdicts.jsonl: a row per verdict (the last word on each) and per failed step."""
    rows: dict[str, dict] = {}
    path = out / "verdicts.jsonl"
    for text in path.read_text().splitlines() if path.exists() else []:
        line = json.loads(text)
        rows[line["verdict"]] = line
    table = ["| verdict | result | measured | bound | detail |", "| --- | --- | --- | --- | --- |"]
    table += [f"| {r['verdict']} | {'PASS' if r['pass'] else 'FAIL'} | {r['measured']} | {r['bound']} | "
              f"{r.get('detail', '')} |" for r in rows.values()]
    failed = sum(not r["pass"] for r in rows.values())
    head = f"# GPU check: {len(rows) - failed} PASS, {failed} FAIL\n\n"
    (out / "verdicts.md").write_text(head + "\n".join(table) + "\n")


def _rmse_ratio(got, ref) -> float:
    """fla's measure: the RMS of the difference over the RMS of the reference."""
    d = (got.double() - ref.double()).square().mean().sqrt()
    return float(d / ref.double().square().mean().sqrt().clamp_min(1e-30))


def _device(tiny: bool):
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if not tiny:
        raise SystemExit("no CUDA device: only --tiny runs on CPU")
    return torch.device("cpu")


@contextlib.contextmanager
def _tf32_off():
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _tests_on_path() -> None:
    sys.path.insert(0, str(REPO / "tests"))


# -- versions ------------------------------------------------------------------------------------------------------
def versions(tiny: bool) -> bool:
    from packtrain import versions as v

    found = v.found_versions()
    lines = v.findings(found)
    return record("versions", not lines, ", ".join(f"{d} {ver}" for d, ver in found.items() if ver),
                  "every package inside packtrain's tested ranges (packtrain/versions.py)", "; ".join(lines))


# -- FlexAttention -----------------------------------------------------------------------------------------------
def flex(tiny: bool) -> bool:
    import torch

    _tests_on_path()
    from tiny_models import random_pack

    from packtrain.packed.attention import attention_batched, attention_dense
    from packtrain.packed.layout import build_pack_layout

    device = _device(tiny)
    heads, groups, dim = (4, 2, 32) if tiny else (24, 4, 256)
    prefix_len, specs = (70, [(20, 10)] * 3) if tiny else (64_000, [(550, 300)] * 80)
    layout = build_pack_layout(*random_pack(prefix_len, specs, seed=0)).to(device)
    if device.type == "cuda":
        from packtrain.packed.kernels import flex as flex_kernel

        kernel, kernel_name = flex_kernel.flex_attention, "FlexAttention"
    else:  # FlexAttention has no CPU backward: the dense path stands in, to run this code
        kernel, kernel_name = attention_dense, "dense (CPU stand-in)"
    g = torch.Generator(device=device).manual_seed(0)
    T = layout.length
    base = [torch.randn(1, h, T, dim, generator=g, device=device) for h in (heads, groups, groups)]
    upstream = torch.randn(1, heads, T, dim, generator=g, device=device)
    scale = dim ** -0.5

    def run(fn, dtype):
        q, k, v = (x.to(dtype, copy=True).requires_grad_() for x in base)
        out = fn(q, k, v, layout, scale, 0.0)
        out.backward(upstream.to(dtype))
        return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad)]

    with _tf32_off():
        truth = run(attention_batched, torch.float32)
        reference = run(attention_batched, torch.bfloat16)
        got = run(kernel, torch.bfloat16)
    names = ("out", "dq", "dk", "dv")
    errors = {n: (_rmse_ratio(a, t), _rmse_ratio(b, t)) for n, a, b, t in zip(names, got, reference, truth)}
    passed = all(e <= FLEX_FACTOR * r + 1e-6 for e, r in errors.values())
    worst = max(names, key=lambda n: errors[n][0] / max(errors[n][1], 1e-12))
    return record("flex", passed, ", ".join(f"{n} {e:.2e} (ref {r:.2e})" for n, (e, r) in errors.items()),
                  f"<= {FLEX_FACTOR:g}x the batched path's bf16 error, vs float32",
                  f"{kernel_name}, T={T}, {heads}/{groups} heads of {dim}; worst {worst}")


# -- Gated DeltaNet -------------------------------------------------------------------------------------------------
def gdn(tiny: bool) -> bool:
    import torch
    import torch.nn.functional as F

    from packtrain.packed.kernels import select_backend, torch_ref

    device = _device(tiny)
    select_backend("fla", device)  # pins fla's kernel (model.gdn_kernel's default) and, on CPU, the interpreter shims
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    H, HV, K, V = (1, 2, 16, 16) if tiny else (16, 48, 128, 128)
    lengths = [37, 1, 70] if tiny else [300 + (97 * i) % 600 for i in range(32)]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16  # the interpreter has no bf16 worth checking
    S, N = sum(lengths), len(lengths)
    g_ = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g_, device=device)

    base = {"q": rand(1, S, H, K), "k": rand(1, S, H, K), "v": rand(1, S, HV, V),
            "g": F.logsigmoid(rand(1, S, HV)) / 16, "beta": rand(1, S, HV).sigmoid(), "h0": rand(N, HV, K, V)}
    do, dht = rand(1, S, HV, V), rand(N, HV, K, V)
    cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def run(fn, dt, **bounds):
        x = {n: t.to(dt if n != "h0" else t.dtype, copy=True).requires_grad_() for n, t in base.items()}
        o, ht = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                   use_qk_l2norm_in_kernel=True, **bounds)
        ((o.float() * do).sum() + (ht.float() * dht).sum()).backward()
        return {"o": o, "ht": ht, **{f"d{n}": x[n].grad for n in ("q", "k", "v", "g", "beta", "h0")}}

    calls = _count_flash_qla_calls()
    with _tf32_off():
        truth = run(torch_ref.chunk_gated_delta_rule, torch.float32, cu_seqlens=cpu.tolist())
        got = run(chunk_gated_delta_rule, dtype, cu_seqlens=cpu.to(device), cu_seqlens_cpu=cpu)
    errors = {n: _rmse_ratio(got[n], truth[n]) for n in GDN_BOUNDS}
    passed = all(errors[n] <= GDN_BOUNDS[n] for n in GDN_BOUNDS)
    record("gdn", passed, ", ".join(f"{n} {e:.2e}" for n, e in errors.items()),
           "fla's fp16 bounds x8: " + ", ".join(f"{n} {b:g}" for n, b in GDN_BOUNDS.items()),
           f"{str(dtype).split('.')[-1]}, {N} sequences ({S} tokens), H {H} / HV {HV}, K = V = {K}")
    return _gdn_kernel_verdict(calls) and passed


def _count_flash_qla_calls() -> list[int]:
    """FlashQLA's entry point counted (fla calls it through its dispatcher when FlashQLA takes a call)."""
    calls = [0]
    try:
        from fla.ops.gated_delta_rule.backends import FlashQLABackend
    except ImportError:
        return calls
    original = FlashQLABackend.chunk_gated_delta_rule

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    FlashQLABackend.chunk_gated_delta_rule = counted
    return calls


def _gdn_kernel_verdict(calls: list[int]) -> bool:
    import importlib.util

    from packtrain.packed.kernels import FLASH_QLA_ENV

    installed = importlib.util.find_spec("flash_qla") is not None
    pinned = "flash_qla" if os.environ.get(FLASH_QLA_ENV) == "1" else "triton"
    ran = "FlashQLA" if calls[0] else "fla Triton"
    passed = (ran == "FlashQLA") == (pinned == "flash_qla")
    return record("gdn_kernel", passed, f"{ran} ran ({calls[0]} FlashQLA calls)",
                  f"the pinned kernel: {pinned} ({FLASH_QLA_ENV}={os.environ.get(FLASH_QLA_ENV)})",
                  f"flash_qla {'installed' if installed else 'not installed'}")


# -- 27B-shaped parity ------------------------------------------------------------------------------------------
def _config_27b(layers: int, tiny: bool) -> dict:
    import yaml

    text = dict(yaml.safe_load((REPO / "configs" / "qwen3.6-27b.yaml").read_text())["model"]["config"])
    kinds = ["linear_attention", "full_attention"] * (layers // 2)
    text.update(num_hidden_layers=len(kinds), layer_types=kinds)
    if tiny:
        text.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=6,
                    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16)
    return text


def parity(tiny: bool) -> bool:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    _tests_on_path()
    from parity import compare
    from tiny_models import random_pack

    from packtrain.models import lora_compute
    from packtrain.packed.kernels import select_backend
    from packtrain.packed.patch import patch_model

    device = _device(tiny)
    text = _config_27b(2, tiny)
    torch.manual_seed(0)
    with device:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "model_type"}))
    with torch.no_grad():  # slow decay, as a trained long-memory head: P's state reaches the continuations
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, -3.0)
    model = get_peft_model(model.to(torch.bfloat16), LoraConfig(  # A and B random: every adapter has a gradient
        r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "in_proj_qkv", "out_proj"]))
    lora_compute.install(model)
    model.enable_input_require_grads()
    prefix, conts = random_pack(300 if tiny else 8192, [(40, 20)] * 4 if tiny else [(400, 200)] * 16,
                                vocab=text["vocab_size"], seed=0)
    gaps = {}
    kernels = {"reference": "torch", "kernels": "auto" if device.type == "cuda" else "torch"}  # the tested one second
    for name, choice in kernels.items():
        backend = select_backend(choice, device)
        same = name == "kernels" and choice == kernels["reference"]  # on CPU both are the torch back end
        gaps[name] = gaps["reference"] if same else (compare(patch_model(model, backend), prefix, conts),
                                                     backend.describe().split(",")[0])
    (ref, ref_name), (got, got_name) = gaps["reference"], gaps["kernels"]
    loss_bound, grad_bound = max(PARITY_FACTOR * ref.loss, 1e-3), max(PARITY_FACTOR * ref.grad, 1e-2)
    return record("parity", got.loss <= loss_bound and got.grad <= grad_bound,
                  f"loss {got.loss:.2e}, gradients {got.grad:.2e} (reference {ref.loss:.2e}, {ref.grad:.2e})",
                  f"<= {PARITY_FACTOR:g}x the torch back end's bf16 gaps on the same model",
                  f"{got_name} vs standalone; reference {ref_name}; hidden {text['hidden_size']}, P {len(prefix)} + "
                  f"{len(conts)} continuations")


# -- the seed's pack step: memory, speed, offload ---------------------------------------------------------------
def _seed_setup(tmp: Path, tiny: bool, **train):
    import yaml

    sys.path.insert(0, str(REPO / "tools" / "data"))
    from make_seed_data import seed_records

    from packtrain.config import load_config
    from packtrain.data.jsonl import load_split
    from packtrain.distributed import DistInfo
    from packtrain.run.units import choose_savings, plan_for

    base = yaml.safe_load((REPO / "configs" / "qwen3.6-27b.yaml").read_text())
    text = _config_27b(2, tiny)
    data = tmp / "seed.jsonl"
    prefix, conts = (64, 2) if tiny else (64_000, 80)
    with data.open("w") as f:
        for rec in seed_records(prefix, conts, text["vocab_size"], 0):
            f.write(json.dumps(rec) + "\n")
    cfg = {**base, "model": {**base["model"], "config": text}, "output_dir": str(tmp / "run"),
           "data": {"train": str(data), "format": "pretokenized"},
           "packing": {**base["packing"], "token_budget": 200_000, "max_continuations": 500},
           "train": {**base["train"], **train}}
    if _device(tiny).type == "cpu":
        cfg["model"].update(dtype="float32", kernels="torch")
        cfg["train"]["device"] = "cpu"
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cfg = load_config(path)
    examples = load_split(cfg, "train")
    plan = plan_for(cfg, examples)
    # the savings left auto, chosen for this device as `train` chooses them (the ones given are kept)
    cfg, _ = choose_savings(cfg, plan, examples, DistInfo(0, 1, 0, _device(tiny)))
    return cfg, examples, plan


def _seed_step(cfg, plan, examples):
    """The trainer's step over the seed's largest pack, assembled as `train` assembles it: (step, its units prepared
    (built once, every update runs them), lm)."""
    import torch

    from packtrain.distributed import DistInfo
    from packtrain.models.build import build_base_model
    from packtrain.models.wrap import assemble
    from packtrain.run.harness import on_every_rank, one_pack, update_step
    from packtrain.run.units import Kinds

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with device:
        base = build_base_model(cfg)
    _, lm, _ = assemble(base, cfg, device)
    kinds = Kinds.of(cfg)
    one, _ = one_pack(plan, examples, kinds, cfg.train.max_positions)
    step = update_step(cfg, lm, kinds, one, examples, DistInfo(0, 1, 0, device))
    return step, step.prepare(on_every_rank(step)), lm


def memory(tiny: bool) -> bool:
    import tempfile

    import torch

    from packtrain.memory.measure import measure_whole
    from packtrain.run.harness import measure_step

    if not torch.cuda.is_available():
        return record("memory", True, "skipped: no CUDA allocator", f"within {MEMORY_TOLERANCE:.0%}", "CPU")
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    from memory_check import cuda_phases

    with tempfile.TemporaryDirectory() as tmp:
        cfg, examples, plan = _seed_setup(Path(tmp), tiny)
        measured = measure_whole(cfg, measure_step(cfg, plan, examples), 1).phases
        cuda = cuda_phases(cfg, plan, examples)
    shared = [p for p in measured if cuda.get(p)]
    dev = {p: abs(measured[p] - cuda[p]) / cuda[p] for p in shared}
    worst = max(dev, key=dev.get) if dev else None
    passed = bool(dev) and all(d <= MEMORY_TOLERANCE for d in dev.values())
    GiB = 2 ** 30
    return record("memory", passed, ", ".join(f"{p} {measured[p] / GiB:.1f}/{cuda[p] / GiB:.1f} GiB" for p in shared),
                  f"--measure within {MEMORY_TOLERANCE:.0%} of max_memory_allocated, every phase",
                  f"worst {worst} {dev[worst]:.1%}" if worst else "no phase measured by both")


def _timed_updates(step, ready, n: int, warmup: bool = True) -> tuple[float, float, int]:
    """(mean seconds of ``n`` updates, after one untimed warm-up (compilation, autotuning); the first update's loss;
    peak allocated bytes of the timed ones)."""
    import torch

    cuda = torch.cuda.is_available()
    loss = step.update(ready, 0).loss if warmup else None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(n):
        first = step.update(ready, 0).loss
        loss = first if loss is None else loss
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n, loss, torch.cuda.max_memory_allocated() if cuda else 0


def speed(tiny: bool) -> bool:
    import tempfile

    from packtrain.bench.timing import model_flops
    from packtrain.data.attention_pairs import pack_pairs
    from packtrain.models.text_config import config_dict_of, text_config

    with tempfile.TemporaryDirectory() as tmp:
        cfg, examples, plan = _seed_setup(Path(tmp), tiny)
        step, ready, _ = _seed_step(cfg, plan, examples)
        seconds, _, _ = _timed_updates(step, ready, 1 if tiny else 2, warmup=not tiny)
    layout = ready.built[0].work
    positions = layout.length
    pairs = pack_pairs(layout.prefix_len, layout.cont_lens)
    text = text_config(config_dict_of(cfg))
    flops = model_flops(text, positions, pairs, int(layout.target_ids.numel()))
    mfu = flops / seconds / (PEAK_TFLOPS * 1e12)
    passed = mfu >= MFU_FLOOR or tiny
    return record("speed", passed, f"{positions / seconds:,.0f} positions/s, MFU {mfu:.1%}",
                  f"MFU >= {MFU_FLOOR:.0%} of {PEAK_TFLOPS:g} TFLOP/s" + (" (--tiny: reported only)" if tiny else ""),
                  f"{positions:,} positions, {seconds:.2f} s per update, 2 layers at 27B widths")


def offload(tiny: bool) -> bool:
    import tempfile

    import torch

    results = {}
    for name, value in (("off", False), ("on", 1)):
        with tempfile.TemporaryDirectory() as tmp:
            cfg, examples, plan = _seed_setup(Path(tmp), tiny, offload=value, activation_checkpointing=True)
            step, ready, lm = _seed_step(cfg, plan, examples)
            results[name] = _timed_updates(step, ready, 1, warmup=not tiny)
            del step, ready, lm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    (t_off, loss_off, peak_off), (t_on, loss_on, peak_on) = results["off"], results["on"]
    cuda = torch.cuda.is_available()  # on CPU the host is the device: the loss alone decides
    passed = loss_on == loss_off and (not cuda or (peak_on < peak_off and t_on <= OFFLOAD_TIME * t_off))
    GiB = 2 ** 30
    return record("offload", passed, f"loss {'equal' if loss_on == loss_off else f'{loss_on!r} vs {loss_off!r}'}, "
                  f"peak {peak_on / GiB:.1f} vs {peak_off / GiB:.1f} GiB, time {t_on / t_off:.2f}x",
                  f"the same loss, a lower peak, <= {OFFLOAD_TIME:g}x the time" + ("" if cuda else " (CPU: the loss)"),
                  "train.offload=1 (one of the two layers' inputs to the host) against false, checkpointing on")


VERDICTS = {"versions": versions, "flex": flex, "gdn": gdn, "gdn_kernel": gdn, "parity": parity, "memory": memory,
            "speed": speed, "offload": offload}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", metavar="NAME")
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU too): the code paths, not the figures")
    ap.add_argument("--list", action="store_true", help="the verdicts this script decides")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(NAMES))
        return 0
    unknown = [n for n in args.names if n not in VERDICTS]
    if unknown or not args.names:
        ap.error(f"unknown verdict {unknown} (of {', '.join(VERDICTS)})" if unknown else "name a verdict")
    ok = True
    for name in args.names:
        try:
            ok = VERDICTS[name](args.tiny) and ok
        except Exception as e:  # noqa: BLE001 - a verdict that could not be decided is a FAIL with its reason
            import traceback

            traceback.print_exc()
            ok = record(name, False, "not decided", "-", f"{type(e).__name__}: {str(e)[:160]}") and False
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
