"""Multi-turn chat through the CLI, per data.train_on: the packed run trains what standalone examples train (in every
packing and context mode, with groups and the walk), and its eval losses equal transformers + peft on the rendered
conversation with labels -100 outside the assistant spans (tests/chat_data.py's reference), on the hybrid text
model, the MoE and the VLM; reasoning, tools and tool responses included.

Tolerances: float64 as shipped (transformers' float32 casts in RMSNorm, the gated norm and the GDN kernel), as in
tests/commands/test_families_cli.py (5e-6 on losses) and tests/commands/test_walk_cli.py (1e-6 on SGD adapters).
"""

import json
import shutil

import pytest
import torch
import yaml
from chat_data import (
    QWEN_LIKE,
    as_objects,
    official_generated_text,
    official_records,
    official_template_path,
    records,
    reference_examples,
    write_jsonl,
)
from cli_helpers import REPO, SGD, TINY_MODEL, TINY_MOE, adapter_of, adapter_rel, run_in_process, write_config

from packtrain.data.jsonl import load_tokenizer

PACKING = {"token_budget": 2400, "max_continuations": 4}


def _config(tmp_path, train_on, model=None, **sections):
    data = {"train": write_jsonl(tmp_path / "chat_train.jsonl", records(train_on, n=2)),
            "eval": write_jsonl(tmp_path / "chat_eval.jsonl", records(train_on, n=1)), "train_on": train_on}
    extra = {"model": {"config": model}} if model else {}
    return write_config(tmp_path, data=data, packing={**PACKING, **sections.pop("packing", {})}, **extra,
                        **sections)


def _eval_rows(cfg, run, out):
    run_in_process("eval", cfg, "--adapter", run / "adapter", "--out", out)
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def _reference_losses(run, eval_path, train_on, moe=False, tok=None, adapter=True, **reference):
    """transformers (+ peft: ``adapter``), one example at a time, on the conversation as the template renders it
    (``reference``: :func:`chat_data.reference_examples`' template arguments)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    eager = {"experts_implementation": "eager"} if moe else {}
    model = AutoModelForCausalLM.from_pretrained(run / "base", dtype=torch.float64, **eager)
    model = (PeftModel.from_pretrained(model, run / "adapter") if adapter else model).eval()
    tok = tok or load_tokenizer()
    out = {}
    with torch.no_grad():
        for line in eval_path.read_text().splitlines():
            for name, ids, labels in reference_examples(tok, json.loads(line), train_on, **reference):
                loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
                out[name] = (loss, sum(t != -100 for t in labels))
    return out


@pytest.mark.parametrize("train_on", ["last", "all", "each"])
def test_eval_losses_equal_transformers_and_peft(tmp_path, train_on):
    cfg = _config(tmp_path, train_on, train={"max_steps": 2, "eval_every": 2})
    header = run_in_process("train", cfg).stdout
    turns = {"last": 6, "all": 8, "each": 14}[train_on]  # tool loops 3 turns, tutoring 3, single 1 (2 of each)
    if train_on != "last":
        assert f"  data.train_on {train_on}: {4 if train_on == 'all' else 6} conversations, {turns} assistant turns " \
               "trained" in header
    run = tmp_path / "run"
    rows = _eval_rows(cfg, run, tmp_path / "e.jsonl")
    reference = _reference_losses(run, tmp_path / "chat_eval.jsonl", train_on)
    assert rows.keys() == reference.keys()
    for name, (loss, targets) in reference.items():
        assert rows[name]["target_tokens"] == targets, name
        assert rows[name]["loss"] == pytest.approx(loss, rel=5e-6), name
    evals = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if m.get("split") == "eval"]
    assert evals[-1]["loss"] == pytest.approx(sum(v[0] for v in reference.values()) / len(reference), rel=5e-6)


@pytest.mark.parametrize("train_on", ["last", "all", "each"])
def test_packed_trains_what_standalone_examples_train(tmp_path, train_on):
    """Every packing mode and context mode on the same data, SGD: the adapters are functions of the gradients."""
    cfg = _config(tmp_path, train_on, optim=SGD, train={"epochs": 1, "packs_per_step": 100})  # one step: all

    def train(name, *sets):
        run_in_process("train", cfg, "--set", f"output_dir={tmp_path / name}", "--set", "data.eval=null", *sets)
        return adapter_of(tmp_path / name)

    alone = train("alone", "--set", "packing.mode=standalone")
    assert adapter_rel(train("packed"), alone) < 1e-6
    if train_on == "last":
        return
    assert adapter_rel(train("groups", "--set", "packing.continuation_groups=2"), alone) < 1e-6
    if train_on == "each":  # several target spans are the new path: the modes below run on `all`
        return
    # the tool loops walk in chunks of 64 under a budget of 600; the rest pack
    walk = train("walk", "--set", "packing.token_budget=600", "--set", "packing.on_overflow=walk",
                 "--set", "packing.walk.chunk=64")
    assert adapter_rel(walk, alone) < 1e-6
    for mode in ("kv_only", "frozen"):
        packed = train(f"packed-{mode}", "--set", f"packing.context_grad={mode}")
        assert adapter_rel(packed, train(f"alone-{mode}", "--set", f"packing.context_grad={mode}",
                                     "--set", "packing.mode=standalone")) < 1e-6
        assert adapter_rel(packed, alone) > 1e-3  # the mode changes the gradient: the comparison can tell


def test_the_27b_configs_data_settings_under_the_official_template_plan_train_and_eval(tmp_path):
    """configs/qwen3.6-27b.yaml's data and packing (chat, the model's template: here Qwen's official Qwen3.6 one
    as data.chat_template, with the Qwen-like tokenizer) on a tiny model: plan counts the examples the split
    tokenization changes, two steps train, and eval (base model and adapter) equals transformers on the reference."""
    raw = yaml.safe_load((REPO / "configs" / "qwen3.6-27b.yaml").read_text())
    template = official_template_path("qwen3.6")
    tok = load_tokenizer(QWEN_LIKE)
    rows = official_records("last")
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    raw["model"] = {"config": TINY_MODEL, "dtype": "float64", "kernels": "torch", "seed": 0}
    raw["data"] = {**raw["data"], "train": data, "eval": data, "chat_template": str(template),
                   "tokenizer": str(QWEN_LIKE)}
    raw["train"] = {**raw["train"], "max_steps": 2, "packs_per_step": 2, "device": "cpu", "offload": False}
    raw["ops"] = {}
    raw["logging"] = {"progress": False}
    raw["output_dir"] = str(tmp_path / "run")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))

    stats = json.loads(run_in_process("plan", cfg, "--json").stdout)
    whole = [tok.apply_chat_template(as_objects(r["messages"]), tools=r.get("tools"), tokenize=False,
                                     chat_template=template.read_text()) for r in rows]
    differs = sum(ids != tok(text, add_special_tokens=False)["input_ids"] for r, text in zip(rows, whole)
                  for _, ids, _ in reference_examples(tok, r, "last", True, official_generated_text("qwen3.6"),
                                                      template.read_text()))
    assert (stats["examples"], stats["whole_differs"]) == (len(rows), differs) and differs > 0
    run_in_process("train", cfg)
    for adapter in (tmp_path / "run" / "adapter", "none"):
        out = tmp_path / f"eval-{adapter == 'none'}.jsonl"
        run_in_process("eval", cfg, "--adapter", adapter, "--out", out)
        got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        reference = _reference_losses(tmp_path / "run", tmp_path / "chat.jsonl", "last", tok=tok,
                                      adapter=adapter != "none", turn_text=official_generated_text("qwen3.6"),
                                      chat_template=template.read_text())
        assert got.keys() == reference.keys()
        for name, (loss, targets) in reference.items():
            assert got[name]["target_tokens"] == targets, name
            assert got[name]["loss"] == pytest.approx(loss, rel=5e-6), name


def test_moe_eval_losses_equal_transformers_and_peft(tmp_path):
    cfg = _config(tmp_path, "all", model={k: v for k, v in TINY_MOE.items() if v is not None},
                  lora={"target_modules": ["q_proj", "v_proj", "in_proj_qkv", "gate_proj", "down_proj"]},
                  train={"max_steps": 1})
    run_in_process("train", cfg)
    rows = _eval_rows(cfg, tmp_path / "run", tmp_path / "e.jsonl")
    reference = _reference_losses(tmp_path / "run", tmp_path / "chat_eval.jsonl", "all", moe=True)
    assert rows.keys() == reference.keys()
    for name, (loss, _) in reference.items():
        assert rows[name]["loss"] == pytest.approx(loss, rel=5e-6), name


def _vlm_chat(i, images):
    ask = [{"type": "image", "image": images[0]}, {"type": "text", "text": "What does this sign mean?"}]
    again = [{"type": "text", "text": "And this one?"}, {"type": "image", "image": images[1]}]
    return {"id": f"vlm{i}", "messages": [
        {"role": "system", "content": "Sign code A. A red circle means down; a blue square means up."},
        {"role": "user", "content": ask}, {"role": "assistant", "content": ["down", "up"][i % 2]},
        {"role": "user", "content": again},
        {"role": "assistant", "content": "up", "reasoning_content": "The second sign is a blue square."}]}


@pytest.mark.parametrize("template", ["bundled", "qwen3.6"])
def test_vlm_eval_losses_equal_transformers_and_peft(tmp_path, template):
    """Qwen3_5ForConditionalGeneration, train_on each: images in the history and in the turn's own question. Under
    Qwen's official Qwen3.6 template (with the Qwen-like tokenizer, whose vision tokens the model config names) the
    packed run also trains what standalone examples train."""
    from peft import PeftModel
    from transformers import AutoImageProcessor, Qwen3_5ForConditionalGeneration

    from packtrain.data.images import IMAGE_PAD, open_image

    names = [f"sign-000{k}.png" for k in (1, 2, 3)]
    for name in names:
        shutil.copy(REPO / "data" / "vlm_demo" / "images" / name, tmp_path / name)
    rows = [_vlm_chat(0, names[:2]), _vlm_chat(1, names[1:])]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    sets = ["--set", f"data.train={data}", "--set", f"data.eval={data}", "--set", "data.format=chat",
            "--set", "data.train_on=each", "--set", f"output_dir={tmp_path / 'run'}", "--set", "train.max_steps=1",
            "--set", "logging.progress=false", "--set", "model.dtype=float64"]
    tok = load_tokenizer(REPO / "packtrain" / "assets" / "vlm")
    reference = {}
    if template != "bundled":
        tok = load_tokenizer(QWEN_LIKE)
        reference = {"turn_text": official_generated_text(template),
                     "chat_template": official_template_path(template).read_text()}
        ids = tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
        sets += ["--set", f"data.tokenizer={QWEN_LIKE}", "--set", f"data.chat_template={official_template_path(template)}",
                 "--set", "model.config.text_config.vocab_size=1024", "--set", "model.config.video_token_id=1023",
                 *(x for key, i in zip(("image", "vision_start", "vision_end"), ids)
                   for x in ("--set", f"model.config.{key}_token_id={i}")),
                 *(x for k, v in SGD.items() for x in ("--set", f"optim.{k}={'null' if v is None else v}")),
                 "--set", "train.epochs=1", "--set", "train.packs_per_rank=1",
                 "--set", "train.packs_per_step=100"]  # one step: all the data
    cfg = str(REPO / "configs" / "vlm_demo.yaml")
    run_in_process("train", cfg, *sets)
    run_in_process("eval", cfg, *sets, "--adapter", tmp_path / "run" / "adapter", "--out", tmp_path / "e.jsonl")
    got = {r["id"]: r for r in map(json.loads, (tmp_path / "e.jsonl").read_text().splitlines())}

    processor = AutoImageProcessor.from_pretrained(str(REPO / "packtrain" / "assets" / "vlm"))
    base = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "run" / "base", dtype=torch.float64)
    model = PeftModel.from_pretrained(base, tmp_path / "run" / "adapter").eval()
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    assert sorted(got) == ["vlm0#1", "vlm0#2", "vlm1#1", "vlm1#2"]
    with torch.no_grad():
        for row in rows:
            for name, ids, labels in reference_examples(tok, row, "each", **reference):
                shown = [p["image"] for m in row["messages"][:{"1": 2, "2": 4}[name[-1]]]
                         if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
                vision = processor(images=[open_image(tmp_path / n) for n in shown], return_tensors="pt")
                per_image = iter([int(g.prod()) // processor.merge_size ** 2 for g in vision["image_grid_thw"]])
                full_ids, full_labels = [], []
                for t, lab in zip(ids, labels):  # one pad per image as rendered -> one per merged patch
                    n = next(per_image) if t == pad else 1
                    full_ids += [t] * n
                    full_labels += [lab] * n
                input_ids = torch.tensor([full_ids])
                loss = model(input_ids=input_ids, labels=torch.tensor([full_labels]),
                             pixel_values=vision["pixel_values"].double(), image_grid_thw=vision["image_grid_thw"],
                             mm_token_type_ids=(input_ids == pad).int()).loss.item()
                assert got[name]["target_tokens"] == sum(t != -100 for t in labels), name
                # float64 as shipped: the VLM's float32 casts (tests/packed/test_vlm.py: 1.1e-5 vs transformers)
                assert got[name]["loss"] == pytest.approx(loss, rel=3e-5), name
    if template != "bundled":  # the run above was packed, SGD, one step over all the data
        alone = tmp_path / "alone"
        run_in_process("train", cfg, *sets, "--set", f"output_dir={alone}", "--set", "packing.mode=standalone")
        # float64 as shipped: the VLM's float32 casts (tests/packed/test_vlm.py)
        assert adapter_rel(adapter_of(tmp_path / "run"), adapter_of(alone)) < 1e-5
