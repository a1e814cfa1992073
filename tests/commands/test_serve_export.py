"""`packtrain export OUTPUT_DIR --for vllm|sglang DIR`: DIR/adapter holds the LoRA part alone, named as the served
checkpoint names its modules; DIR/model is the base with the trained modules_to_save folded in, so that transformers +
peft on (DIR/model, DIR/adapter) compute what they compute on the run's base and adapter. Every export carries the
run's chat template and tokenizer, no image processor for a text model, and files of one mode. What a server cannot
apply is refused naming the module. (tests/serve runs vLLM itself on such exports.)"""

import json
import shutil

import pytest
import torch
import yaml
from checkpoints import save_checkpoint, vlm_config
from cli_helpers import REPO, TINY_MOE, run_in_process, write_config
from safetensors import safe_open
from safetensors.torch import load_file

# routes transformers' CPU kernels (the reference forwards here), as every packtrain process does: with fla
# installed they would otherwise reach fla's kernels, which fail uncompiled on CPU ("0 active drivers")
import packtrain.packed.patch  # noqa: F401
from packtrain.models.exports import new_file_mode

CHATML = REPO / "data" / "demo" / "chatml.jinja"  # not the bundled tokenizer's own template
GDN_AND_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "in_proj_qkv", "in_proj_z", "out_proj"]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def _with_adapter(cls, model_dir, adapter_dir, **kw):
    from peft import PeftModel

    return PeftModel.from_pretrained(cls.from_pretrained(model_dir, dtype=torch.float64, **kw), adapter_dir).eval()


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A text run with data.chat_template, the head trained in full and LoRA on attention and the GDN projections;
    exported for vLLM and merged."""
    tmp = tmp_path_factory.mktemp("text")
    cfg = write_config(tmp, data={"chat_template": str(CHATML)},
                       lora={"target_modules": GDN_AND_ATTENTION, "modules_to_save": ["lm_head"]},
                       train={"max_steps": 2})
    proc = run_in_process("train", cfg)
    out = run_in_process("export", tmp / "run", "--for", "vllm", tmp / "vllm")
    run_in_process("export", tmp / "run", "--merged", tmp / "merged")
    return {"tmp": tmp, "run": tmp / "run", "train": proc.stdout, "export": out.stdout}


def test_the_run_header_names_the_servers(text_run):
    assert ("serve: vllm yes, sglang no (in_proj_qkv, in_proj_z), merged yes; lm_head (modules_to_save) folded into "
            "the served model by packtrain export --for") in " ".join(text_run["train"].split())  # wrapped at 120


def test_the_vllm_export_computes_what_the_run_computes(text_run):
    from transformers import Qwen3_5ForCausalLM

    tmp, run = text_run["tmp"], text_run["run"]
    config = json.loads((tmp / "vllm" / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] is None
    tensors = load_file(str(tmp / "vllm" / "adapter" / "adapter_model.safetensors"))
    assert tensors and all(".lora_" in k for k in tensors)
    assert tensors.keys() == {k for k in load_file(str(run / "adapter" / "adapter_model.safetensors")) if ".lora_" in k}
    ids = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(0))
    expected = _logits(_with_adapter(Qwen3_5ForCausalLM, run / "base", run / "adapter"), ids)
    served = _logits(_with_adapter(Qwen3_5ForCausalLM, tmp / "vllm" / "model", tmp / "vllm" / "adapter"), ids)
    torch.testing.assert_close(served, expected, rtol=0, atol=1e-12)
    base = _logits(Qwen3_5ForCausalLM.from_pretrained(run / "base", dtype=torch.float64).eval(), ids)
    assert (expected - base).abs().max() > 1e-3  # the adapter and the head change the logits
    with safe_open(str(tmp / "vllm" / "model" / "model.safetensors"), "pt") as f:  # the trained head folded in
        head = f.get_tensor("lm_head.weight")
    trained = load_file(str(run / "adapter" / "adapter_model.safetensors"))["base_model.model.lm_head.weight"]
    assert torch.equal(head, trained.to(head.dtype))


def test_every_export_carries_the_run_chat_template(text_run):
    from transformers import AutoTokenizer

    template = CHATML.read_text()
    for folder in (text_run["tmp"] / "vllm" / "model", text_run["tmp"] / "merged", text_run["run"] / "tokenizer"):
        assert AutoTokenizer.from_pretrained(folder).chat_template == template, folder
        assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
        assert not (folder / "preprocessor_config.json").exists()  # a text model: no image processor


def test_a_run_directory_without_its_tokenizer_exports_from_the_config(text_run, tmp_path):
    """A run written before OUTPUT/tokenizer existed: the config's data.chat_template, found from here."""
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    shutil.copytree(text_run["run"], run, ignore=shutil.ignore_patterns("tokenizer", "checkpoints"))
    run_in_process("export", run, "--merged", tmp_path / "merged")
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").chat_template == CHATML.read_text()
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"]["chat_template"] = "gone/chatml.jinja"
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    proc = run_in_process("export", run, "--for", "vllm", tmp_path / "vllm", check=False)
    assert proc.returncode == 2 and "data.chat_template gone/chatml.jinja not found" in proc.stderr
    assert not (tmp_path / "vllm").exists()


def test_export_files_have_one_mode(text_run):
    mode = new_file_mode()
    for folder in (text_run["tmp"] / "vllm", text_run["tmp"] / "merged", text_run["run"] / "adapter"):
        modes = {p.relative_to(folder): p.stat().st_mode & 0o777 for p in folder.rglob("*") if p.is_file()}
        assert modes and set(modes.values()) == {mode}, modes


def test_the_export_prints_the_vllm_lines(text_run):
    out, tmp = text_run["export"], text_run["tmp"].resolve()
    assert (f"serve it: vllm serve {tmp / 'vllm' / 'model'} --enable-lora --max-lora-rank 8 --lora-modules "
            f"run={tmp / 'vllm' / 'adapter'}") in out
    assert f"LoRARequest('run', 1, '{tmp / 'vllm' / 'adapter'}')" in out


def test_sglang_refuses_the_split_gdn_projections_naming_them(text_run, tmp_path):
    proc = run_in_process("export", text_run["run"], "--for", "sglang", tmp_path / "sg", check=False)
    assert proc.returncode == 2 and not (tmp_path / "sg").exists()
    err = proc.stderr
    assert "sglang 0.5.23 cannot apply this adapter: in_proj_qkv:" in err and "in_proj_z:" in err
    assert "--merged DIR" in err


def test_sglang_export_of_modules_it_applies(tmp_path):
    cfg = write_config(tmp_path, lora={"target_modules": ["q_proj", "o_proj", "out_proj"],
                                       "modules_to_save": ["lm_head"]}, train={"max_steps": 1}, data={"eval": None})
    run_in_process("train", cfg)
    out = run_in_process("export", tmp_path / "run", "--for", "sglang", tmp_path / "sg").stdout
    assert "python -m sglang.launch_server --model-path" in out
    assert "--lora-target-modules o_proj out_proj q_proj" in out
    config = json.loads((tmp_path / "sg" / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] is None


def test_vllm_before_034_refuses_a_lone_in_proj_z(tmp_path):
    cfg = write_config(tmp_path, lora={"target_modules": ["q_proj", "in_proj_z"]}, train={"max_steps": 1},
                       data={"eval": None})
    run_in_process("train", cfg)
    proc = run_in_process("export", tmp_path / "run", "--for", "vllm", tmp_path / "v", check=False)
    assert proc.returncode == 2 and "vllm 0.32.0 cannot apply this adapter: in_proj_z: without in_proj_qkv" in \
        proc.stderr
    assert "--server-version" in proc.stderr and not (tmp_path / "v").exists()
    run_in_process("export", tmp_path / "run", "--for", "vllm", tmp_path / "v", "--server-version", "0.34.0")
    assert (tmp_path / "v" / "adapter" / "adapter_model.safetensors").is_file()


def test_an_unknown_server_is_refused(text_run, tmp_path):
    proc = run_in_process("export", text_run["run"], "--for", "tgi", tmp_path / "x", check=False)
    assert proc.returncode == 2 and "unknown server 'tgi' (one of vllm, sglang)" in proc.stderr


def test_vision_language_export_names_the_checkpoints_modules_and_folds_the_merger(tmp_path):
    """An adapter trained on the text class, served on the vision-language checkpoint (`--base`): its keys are put in
    the checkpoint's layout (vLLM applies none of the text layout there, peft loads none of it), the trained merger
    and head folded into the model."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    base_dir = save_checkpoint(tmp_path / "base", vlm_config(), dtype=torch.float64)  # the folded head: exact
    model = Qwen3_5ForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float64)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                  target_modules=["q_proj", "v_proj", "in_proj_qkv"],
                                                  modules_to_save=["merger", "lm_head"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.05)
    run = tmp_path / "run"
    peft_model.save_pretrained(run / "adapter")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(base_dir), "config": None}}))
    run_in_process("export", run, "--for", "vllm", tmp_path / "v")
    tensors = load_file(str(tmp_path / "v" / "adapter" / "adapter_model.safetensors"))
    assert tensors and all(k.startswith("base_model.model.model.language_model.layers.") for k in tensors)
    ids = torch.randint(0, 1000, (1, 11), generator=torch.Generator().manual_seed(0))
    expected = _logits(_with_adapter(Qwen3_5ForConditionalGeneration, base_dir, run / "adapter"), ids)
    served = _logits(_with_adapter(Qwen3_5ForConditionalGeneration, tmp_path / "v" / "model",
                                   tmp_path / "v" / "adapter"), ids)
    torch.testing.assert_close(served, expected, rtol=0, atol=1e-12)
    assert (tmp_path / "v" / "model" / "preprocessor_config.json").is_file()  # vision-language: the processor
    merged_merger = _stored(tmp_path / "v" / "model", "model.visual.merger.")
    trained = {k.replace("base_model.model.", ""): v for k, v in load_file(
        str(run / "adapter" / "adapter_model.safetensors")).items() if ".merger." in k}
    assert merged_merger.keys() == trained.keys()
    assert all(torch.equal(merged_merger[k], trained[k].to(merged_merger[k].dtype)) for k in trained)
    # the same LoRA on the text class's checkpoint, exported for the vision-language one with --base
    text_dir = tmp_path / "text"
    Qwen3_5ForCausalLM.from_pretrained(base_dir, dtype=torch.float64).save_pretrained(text_dir)
    torch.manual_seed(1)
    text_peft = get_peft_model(Qwen3_5ForCausalLM.from_pretrained(text_dir, dtype=torch.float64),
                               LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                          target_modules=["q_proj", "v_proj", "in_proj_qkv"]))
    text_run = tmp_path / "text-run"
    text_peft.save_pretrained(text_run / "adapter")
    (text_run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(text_dir), "config": None}}))
    out = run_in_process("export", text_run, "--for", "vllm", tmp_path / "tv", "--base", base_dir).stdout
    assert "module names put in the vision-language layout" in out
    keys = load_file(str(tmp_path / "tv" / "adapter" / "adapter_model.safetensors"))
    assert keys and all(k.startswith("base_model.model.model.language_model.layers.") for k in keys)
    on_text = _logits(_with_adapter(Qwen3_5ForCausalLM, text_dir, text_run / "adapter"), ids)
    on_vl = _logits(_with_adapter(Qwen3_5ForConditionalGeneration, tmp_path / "tv" / "model",
                                  tmp_path / "tv" / "adapter"), ids)
    torch.testing.assert_close(on_vl, on_text, rtol=0, atol=1e-12)


def _stored(model_dir, prefix):
    """The checkpoint's tensors whose names start with ``prefix``, from whichever shards hold them."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for key, shard in index.items():
        if key.startswith(prefix):
            with safe_open(str(model_dir / shard), "pt") as f:
                out[key] = f.get_tensor(key)
    return out


def test_moe_export_keeps_the_experts_and_asks_for_vllms_mixed_format(tmp_path):
    """peft's routed-expert LoRA (lora.target_parameters) is the fused 3D layout: the export keeps it, names the
    checkpoint's modules and prints the engine flag and the request argument vLLM needs for it."""
    from transformers import AutoModelForCausalLM

    cfg = write_config(tmp_path, model={"config": TINY_MOE},
                       lora={"target_modules": ["q_proj", "in_proj_qkv", "gate_proj"],
                             "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                             "modules_to_save": ["lm_head"]},
                       train={"max_steps": 1}, data={"eval": None})
    run_in_process("train", cfg)
    out = run_in_process("export", tmp_path / "run", "--for", "vllm", tmp_path / "v").stdout
    assert "--enable-mixed-moe-lora-format" in out and "is_3d_lora_weight=True" in out
    keys = load_file(str(tmp_path / "v" / "adapter" / "adapter_model.safetensors"))
    assert any(".mlp.experts.base_layer.lora_A" in k for k in keys) and any(".mlp.experts.lora_B" in k for k in keys)
    assert all(".lora_" in k for k in keys)
    ids = torch.randint(0, 1000, (1, 11), generator=torch.Generator().manual_seed(0))
    eager = {"experts_implementation": "eager"}  # transformers' grouped_mm has no float64 kernel
    expected = _logits(_with_adapter(AutoModelForCausalLM, tmp_path / "run" / "base", tmp_path / "run" / "adapter",
                                     **eager), ids)
    served = _logits(_with_adapter(AutoModelForCausalLM, tmp_path / "v" / "model", tmp_path / "v" / "adapter",
                                   **eager), ids)
    torch.testing.assert_close(served, expected, rtol=0, atol=1e-12)
