"""packtrain.models.exports called directly, on a tiny sharded checkpoint and adapters written by hand (no peft, no
training): each merged tensor is W + scale * B @ A computed here in float64 and rounded once to the checkpoint's
dtype (rsLoRA, rank and alpha patterns, an embedding, a start adapter folded first), a trained modules_to_save tensor
is cast once, the base's shards, index and untouched bytes are kept, the ``--for`` export writes the LoRA part alone
and the serve lines its ranks need, and every refusal names what it refuses before anything is written.
The ``packtrain export`` command itself: tests/commands/test_export.py and test_serve_export.py."""

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import save_checkpoint, text_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from packtrain.models import exports
from packtrain.models import start_adapter as sa

PEFT = "base_model.model."
Q, K, V = (f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj"))
QKV0, QKV2 = "model.layers.0.linear_attn.in_proj_qkv", "model.layers.2.linear_attn.in_proj_qkv"
EMBED = "model.embed_tokens"
SHAPES = {Q: (128, 32), K: (32, 32), V: (32, 32), QKV0: (64, 32), QKV2: (64, 32), EMBED: (1024, 32)}
HEAD = "lm_head.weight"


def _quiet(line):
    pass


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """``base(dtype, **save_checkpoint options)``: the tiny text checkpoint (4 shards and an ``mtp.*`` shard by
    default), written once per module for each form asked for. Read it; copy it to change it."""
    made = {}

    def get(dtype=torch.float32, **kw):
        key = (dtype, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = save_checkpoint(tmp_path_factory.mktemp("base"), text_config(), dtype=dtype, **kw)
        return made[key]

    return get


def _adapter(path, ranks, *, dtype=torch.float32, saved=None, seed=0, **config):
    """A peft LoRA adapter directory: ``ranks`` module -> r, random factors of ``dtype`` (an embedding's in peft's
    ``lora_embedding_A/B`` layout), ``saved`` tensor name -> a trained modules_to_save tensor. Returns its tensors."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, r in ranks.items():
        rows, cols = SHAPES[module]
        if module == EMBED:  # A (r, vocab), B (dim, r); the delta (B @ A).T
            tensors[f"{PEFT}{module}.lora_embedding_A"] = (torch.randn(r, rows, generator=g) * 0.3).to(dtype)
            tensors[f"{PEFT}{module}.lora_embedding_B"] = (torch.randn(cols, r, generator=g) * 0.3).to(dtype)
        else:
            tensors[f"{PEFT}{module}.lora_A.weight"] = (torch.randn(r, cols, generator=g) * 0.3).to(dtype)
            tensors[f"{PEFT}{module}.lora_B.weight"] = (torch.randn(rows, r, generator=g) * 0.3).to(dtype)
    tensors.update({PEFT + k: v for k, v in (saved or {}).items()})
    path.mkdir(parents=True)
    save_file(tensors, str(path / exports.ADAPTER_WEIGHTS))
    modules = sorted({k.rsplit(".", 1)[0] for k in saved or {}})
    settings = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": sorted(ranks),
                "modules_to_save": modules or None, **config}
    (path / exports.ADAPTER_CONFIG).write_text(json.dumps(settings))
    return tensors


def _delta(tensors, module, scale):
    """scale * B @ A in float64, by hand (an embedding's transposed)."""
    if module == EMBED:
        a, b = (tensors[f"{PEFT}{module}.lora_embedding_{x}"].double() for x in "AB")
        return scale * (b @ a).T
    a, b = (tensors[f"{PEFT}{module}.lora_{x}.weight"].double() for x in "AB")
    return scale * b @ a


def _magnitude(tensors, module, scale):
    a, b = (tensors[f"{PEFT}{module}.lora_{x}.weight"].double().abs() for x in "AB")
    return scale * b @ a


def _index(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _tensors(folder):
    """Every tensor of a checkpoint directory, from whichever file holds it."""
    if not (folder / "model.safetensors.index.json").is_file():
        return load_file(str(folder / "model.safetensors"))
    out = {}
    for shard in sorted(set(_index(folder)["weight_map"].values())):
        out.update(load_file(str(folder / shard)))
    return out


def _assert_rounded_once(out, exact, magnitude, wide):
    """``out`` is ``exact`` rounded once to ``out``'s dtype: within half a unit in its last place, plus what
    computing the sum in ``wide`` may err (a second rounding, of the delta or of the sum, errs by up to a unit)."""
    _, exponent = torch.frexp(exact)
    precision = 1 - round(math.log2(torch.finfo(out.dtype).eps))  # significand bits, the implicit one included
    ulp = torch.ldexp(torch.ones_like(exact), exponent - precision)
    slack = 8 * torch.finfo(wide).eps * magnitude
    error = (out.double() - exact).abs()
    bad = error > ulp / 2 + slack
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} not rounded once, worst {float((error / ulp).max())} ulp"


# -- the merge arithmetic --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ckpt_dtype, factor_dtype, sum_dtype", [
    pytest.param(torch.bfloat16, torch.bfloat16, torch.float32, id="bf16-bf16"),
    pytest.param(torch.bfloat16, torch.float32, torch.float32, id="bf16-f32"),
    pytest.param(torch.bfloat16, torch.float64, torch.float64, id="bf16-f64"),
    pytest.param(torch.float64, torch.float64, torch.float64, id="f64-f64"),
    pytest.param(torch.float32, torch.float64, torch.float64, id="f32-f64")])
def test_a_merged_tensor_is_rounded_once_to_the_checkpoints_dtype(base, tmp_path, ckpt_dtype, factor_dtype,
                                                                  sum_dtype):
    """Factors of any dtype merge in theirs, float32 at least (a float64 run's are not rounded to float32), the sum
    in ``sum_dtype`` at least, and a bf16 checkpoint's sum is not rounded to bf16 before it is written."""
    ckpt = base(ckpt_dtype)
    tensors = _adapter(tmp_path / "a", {Q: 4, QKV0: 4}, dtype=factor_dtype)
    report = exports.export_merged(ckpt, tmp_path / "a", tmp_path / "m", exports.RunFiles(None), log=_quiet)
    before, after = _tensors(ckpt), _tensors(tmp_path / "m")
    for module in (Q, QKV0):
        w, out = before[f"{module}.weight"], after[f"{module}.weight"]
        assert out.dtype == ckpt_dtype
        exact = w.double() + _delta(tensors, module, 2.0)
        _assert_rounded_once(out, exact, w.double().abs() + _magnitude(tensors, module, 2.0), sum_dtype)
    assert report["changed_tensors"] == 2


SCALES = {  # r 4, lora_alpha 8; patterns: q_proj r 2, layer 2's in_proj_qkv r 6, in_proj_qkv alpha 16, v_proj alpha 3
    "plain": ({}, {Q: 8 / 4, V: 8 / 4, QKV0: 8 / 4, QKV2: 8 / 4, EMBED: 8 / 4}),
    "rslora": ({"use_rslora": True}, {Q: 8 / 2, V: 8 / 2, QKV0: 8 / 2, QKV2: 8 / 2, EMBED: 8 / 2}),
    "patterns": ({"rank_pattern": {"q_proj": 2, QKV2: 6}, "alpha_pattern": {"in_proj_qkv": 16, "v_proj": 3}},
                 {Q: 8 / 2, V: 3 / 4, QKV0: 16 / 4, QKV2: 16 / 6, EMBED: 8 / 4}),
    "rslora-patterns": ({"use_rslora": True, "rank_pattern": {"q_proj": 2, QKV2: 6},
                         "alpha_pattern": {"in_proj_qkv": 16, "v_proj": 3}},
                        {Q: 8 / math.sqrt(2), V: 3 / 2, QKV0: 16 / 2, QKV2: 16 / math.sqrt(6), EMBED: 8 / 2}),
}


@pytest.mark.parametrize("kind", list(SCALES))
def test_each_module_merges_with_its_own_scale(base, tmp_path, kind):
    config, scales = SCALES[kind]
    ranks = {m: 4 for m in scales}
    ranks.update({Q: 2, QKV2: 6} if "rank_pattern" in config else {})
    tensors = _adapter(tmp_path / "a", ranks, dtype=torch.float64, **config)
    exports.export_merged(base(), tmp_path / "a", tmp_path / "m", exports.RunFiles(None), log=_quiet)
    before, after = _tensors(base()), _tensors(tmp_path / "m")
    for module, scale in scales.items():
        expected = (before[f"{module}.weight"].double() + _delta(tensors, module, scale)).float()
        torch.testing.assert_close(after[f"{module}.weight"], expected, rtol=0, atol=1e-6, msg=module)
    untouched = [k for k in before if not k.startswith(tuple(scales))]
    assert all(torch.equal(before[k], after[k]) for k in untouched)


def test_a_trained_module_replaces_the_checkpoints_cast_once(base, tmp_path):
    head = torch.randn(1024, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    _adapter(tmp_path / "a", {Q: 4}, saved={HEAD: head.float()})
    report = exports.export_merged(base(torch.bfloat16), tmp_path / "a", tmp_path / "m", exports.RunFiles(None),
                                   log=_quiet)
    after = _tensors(tmp_path / "m")
    assert after[HEAD].dtype == torch.bfloat16 and torch.equal(after[HEAD], head.float().bfloat16())
    assert not torch.equal(after[f"{Q}.weight"], _tensors(base(torch.bfloat16))[f"{Q}.weight"])
    assert report["changed_tensors"] == 2


def test_the_start_adapter_folds_in_first(base, tmp_path):
    """A run trained on base + model.adapter: the start's delta, rounded to the checkpoint's dtype, then the run's;
    the ``--for`` model holds the start alone (the run's LoRA stays in the adapter)."""
    start = _adapter(tmp_path / "start", {Q: 4, K: 4}, dtype=torch.float64, seed=1)
    run = _adapter(tmp_path / "run", {Q: 4, V: 4}, dtype=torch.float64, seed=2)
    chain = sa.read_chain(tmp_path / "start", [], "the test's base")
    report = exports.export_merged(base(), tmp_path / "run", tmp_path / "m", exports.RunFiles(None), log=_quiet,
                                   start=chain)
    before, after = _tensors(base()), _tensors(tmp_path / "m")

    def w(m):
        return before[f"{m}.weight"].double()

    expected = {Q: (w(Q) + _delta(start, Q, 2)).float().double() + _delta(run, Q, 2),
                K: w(K) + _delta(start, K, 2), V: w(V) + _delta(run, V, 2)}
    for module, value in expected.items():
        torch.testing.assert_close(after[f"{module}.weight"], value.float(), rtol=0, atol=1e-6, msg=module)
    assert report["changed_tensors"] == 3
    exports.export_for("vllm", base(), tmp_path / "run", tmp_path / "v", exports.RunFiles(None), "x", log=_quiet,
                       start=chain)
    served = _tensors(tmp_path / "v" / "model")
    for module, value in {Q: w(Q) + _delta(start, Q, 2), K: w(K) + _delta(start, K, 2), V: w(V)}.items():
        torch.testing.assert_close(served[f"{module}.weight"], value.float(), rtol=0, atol=1e-6, msg=module)


def test_a_vision_language_layout_adapter_merges_into_a_text_checkpoint(base, tmp_path):
    """Keys named model.language_model.* (the vision-language class's) put in the text checkpoint's layout."""
    tensors = _adapter(tmp_path / "a", {Q: 4}, target_modules=["q_proj"])
    vl = {k.replace(PEFT + "model.", PEFT + "model.language_model."): v for k, v in tensors.items()}
    save_file(vl, str(tmp_path / "a" / exports.ADAPTER_WEIGHTS))
    lines = []
    exports.export_merged(base(), tmp_path / "a", tmp_path / "m", exports.RunFiles(None), log=lines.append)
    assert f"packtrain export: the adapter's module names put in the text layout of {base()}" in lines
    expected = (_tensors(base())[f"{Q}.weight"].double() + _delta(tensors, Q, 2)).float()
    torch.testing.assert_close(_tensors(tmp_path / "m")[f"{Q}.weight"], expected, rtol=0, atol=1e-6)
    exports.export_for("vllm", base(), tmp_path / "a", tmp_path / "v", exports.RunFiles(None), "x", log=_quiet)
    served = load_file(str(tmp_path / "v" / "adapter" / exports.ADAPTER_WEIGHTS))
    assert served.keys() == tensors.keys()
    assert all(torch.equal(served[k], tensors[k]) for k in tensors)


def test_whole_module_paths_of_the_adapter_config_follow_the_rename(base, tmp_path):
    """An adapter of the vision-language layout whose config names its modules by their whole paths
    (target_modules, and rank_pattern / alpha_pattern keys): renamed with the tensors, so peft targets the module
    at its rank and alpha (left as they were, peft targeted nothing there and gave the default rank: a shape
    error). The merge uses alpha / r = 3 / 6, and the served adapter's config names the checkpoint's modules."""
    vl_q = Q.replace("model.", "model.language_model.", 1)
    tensors = _adapter(tmp_path / "a", {Q: 6}, target_modules=[vl_q], rank_pattern={vl_q: 6}, alpha_pattern={vl_q: 3})
    vl = {k.replace(PEFT + "model.", PEFT + "model.language_model."): v for k, v in tensors.items()}
    save_file(vl, str(tmp_path / "a" / exports.ADAPTER_WEIGHTS))
    exports.export_merged(base(), tmp_path / "a", tmp_path / "m", exports.RunFiles(None), log=_quiet)
    expected = (_tensors(base())[f"{Q}.weight"].double() + _delta(tensors, Q, 3 / 6)).float()
    torch.testing.assert_close(_tensors(tmp_path / "m")[f"{Q}.weight"], expected, rtol=0, atol=1e-6)
    exports.export_for("vllm", base(), tmp_path / "a", tmp_path / "v", exports.RunFiles(None), "x", log=_quiet)
    served = json.loads((tmp_path / "v" / "adapter" / exports.ADAPTER_CONFIG).read_text())
    assert (served["target_modules"], served["rank_pattern"], served["alpha_pattern"]) == ([Q], {Q: 6}, {Q: 3})


# -- the checkpoint's layout -----------------------------------------------------------------------------------------

def test_the_shards_index_and_untouched_bytes_are_kept(base, tmp_path):
    ckpt = tmp_path / "base"
    shutil.copytree(base(), ckpt)
    index = _index(ckpt)
    index["metadata"]["note"] = "kept"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _adapter(tmp_path / "a", {Q: 4})
    report = exports.export_merged(ckpt, tmp_path / "a", tmp_path / "m", exports.RunFiles(None), log=_quiet)
    out = _index(tmp_path / "m")
    shards = sorted(set(index["weight_map"].values()))
    assert out["weight_map"] == index["weight_map"] and out["metadata"]["note"] == "kept"
    assert out["metadata"]["total_size"] == sum((tmp_path / "m" / s).stat().st_size for s in shards)
    touched = index["weight_map"][f"{Q}.weight"]
    for shard in shards:
        if shard != touched:
            assert (tmp_path / "m" / shard).read_bytes() == (ckpt / shard).read_bytes(), shard
    with safe_open(str(ckpt / touched), "pt") as f, safe_open(str(tmp_path / "m" / touched), "pt") as g:
        assert g.metadata() == f.metadata() and set(g.keys()) == set(f.keys())
        for key in f.keys():  # noqa: SIM118 - a safetensors handle
            if key != f"{Q}.weight":
                assert torch.equal(g.get_tensor(key), f.get_tensor(key)), key
    assert report == {"changed_tensors": 1, "shards": len(shards), "shards_copied_unchanged": len(shards) - 1,
                      "carried_over_not_loaded": 3, "files": report["files"]}


def test_a_single_file_checkpoint_gets_an_index(base, tmp_path):
    ckpt = base(torch.float32, shard_kb=None, mtp=False)
    _adapter(tmp_path / "a", {Q: 4})
    report = exports.export_merged(ckpt, tmp_path / "a", tmp_path / "m", exports.RunFiles(None), log=_quiet)
    keys = set(load_file(str(ckpt / "model.safetensors")))
    index = _index(tmp_path / "m")
    assert index["weight_map"] == {k: "model.safetensors" for k in keys}
    assert index["metadata"]["total_size"] == (tmp_path / "m" / "model.safetensors").stat().st_size
    assert report["shards"] == 1 and report["shards_copied_unchanged"] == 0 and report["changed_tensors"] == 1


# -- --for vllm|sglang -----------------------------------------------------------------------------------------------

def test_the_served_adapter_is_the_lora_part_and_the_model_holds_the_trained_head(base, tmp_path, monkeypatch):
    ckpt = base(torch.bfloat16)
    head = torch.randn(1024, 32, generator=torch.Generator().manual_seed(5))
    tensors = _adapter(tmp_path / "a", {Q: 4, V: 12}, dtype=torch.float64, saved={HEAD: head},
                       rank_pattern={"v_proj": 12}, use_rslora=True)
    monkeypatch.chdir(tmp_path)
    report = exports.export_for("vllm", ckpt, tmp_path / "a", Path("v"), exports.RunFiles(None), "my-run",
                                log=_quiet)
    served = load_file(str(tmp_path / "v" / "adapter" / exports.ADAPTER_WEIGHTS))
    assert served.keys() == {k for k in tensors if ".lora_" in k}
    assert all(served[k].dtype == torch.float64 and torch.equal(served[k], tensors[k]) for k in served)
    config = json.loads((tmp_path / "v" / "adapter" / exports.ADAPTER_CONFIG).read_text())
    assert config["modules_to_save"] is None and config["inference_mode"] is True
    assert config["base_model_name_or_path"] == str(tmp_path.resolve() / "v" / "model")
    assert config["rank_pattern"] == {"v_proj": 12} and config["use_rslora"] is True
    before, model = _tensors(ckpt), _tensors(tmp_path / "v" / "model")
    assert torch.equal(model[HEAD], head.bfloat16())
    assert all(torch.equal(model[k], before[k]) for k in before if k != HEAD)  # LoRA targets not merged
    assert report["changed_tensors"] == 1 and report["lora_tensors"] == 4 and report["folded"] == ["lm_head"]
    model_dir, adapter_dir = tmp_path.resolve() / "v" / "model", tmp_path.resolve() / "v" / "adapter"
    assert report["serve"][0] == (f"serve it: vllm serve {model_dir} --enable-lora --max-lora-rank 16 --lora-modules "
                                  f"my-run={adapter_dir}")
    assert "max_lora_rank=16)" in report["serve"][1]


def test_without_trained_modules_the_served_model_is_the_base(base, tmp_path):
    _adapter(tmp_path / "a", {Q: 4})
    report = exports.export_for("vllm", base(), tmp_path / "a", tmp_path / "v", exports.RunFiles(None), "x",
                                log=_quiet)
    shards = set(_index(base())["weight_map"].values())
    assert report["changed_tensors"] == 0 and report["shards_copied_unchanged"] == report["shards"] == len(shards)
    assert report["folded"] == []
    for shard in shards:
        assert (tmp_path / "v" / "model" / shard).read_bytes() == (base() / shard).read_bytes()


def test_sglangs_line_names_the_largest_rank_and_the_targets(base, tmp_path):
    _adapter(tmp_path / "a", {Q: 4, V: 12, "model.layers.1.self_attn.k_proj": 4},
             rank_pattern={"v_proj": 12})
    report = exports.export_for("sglang", base(), tmp_path / "a", tmp_path / "s", exports.RunFiles(None), "x",
                                log=_quiet)
    s = tmp_path.resolve() / "s"
    line = (f"serve it: python -m sglang.launch_server --model-path {s / 'model'} --enable-lora --lora-paths "
            f"x={s / 'adapter'} --max-lora-rank 12 --lora-target-modules k_proj q_proj v_proj")
    assert report["serve"] == [line]


def test_a_rank_vllm_refuses_is_refused_before_anything_is_written(base, tmp_path):
    _adapter(tmp_path / "a", {Q: 4, V: 600}, rank_pattern={"v_proj": 600})
    with pytest.raises(ValueError, match=r"lora rank 600 is above the largest vLLM serves \(512\)"):
        exports.export_for("vllm", base(), tmp_path / "a", tmp_path / "v", exports.RunFiles(None), "x", log=_quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_module_the_server_cannot_apply_is_refused_before_anything_is_written(base, tmp_path):
    _adapter(tmp_path / "a", {Q: 4, QKV0: 4, QKV2: 4})
    with pytest.raises(ValueError) as e:
        exports.export_for("sglang", base(), tmp_path / "a", tmp_path / "s", exports.RunFiles(None), "x", log=_quiet)
    message = str(e.value)
    assert message.startswith("--for sglang: ") and "in_proj_qkv" in message
    assert "Alternatives: --merged DIR" in message and "lora.target_modules that sglang applies" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


# -- refusals --------------------------------------------------------------------------------------------------------

def _ia3(path):
    config = json.loads((path / exports.ADAPTER_CONFIG).read_text())
    (path / exports.ADAPTER_CONFIG).write_text(json.dumps(
        {"peft_type": "IA3", "target_modules": config["target_modules"], "feedforward_modules": []}))


def _config(**over):
    def edit(path):
        config = json.loads((path / exports.ADAPTER_CONFIG).read_text())
        (path / exports.ADAPTER_CONFIG).write_text(json.dumps({**config, **over}))
    return edit


def _drop_b(path):
    tensors = load_file(str(path / exports.ADAPTER_WEIGHTS))
    del tensors[f"{PEFT}{Q}.lora_B.weight"]
    save_file(tensors, str(path / exports.ADAPTER_WEIGHTS))


def _rename(old, new):
    def edit(path):
        tensors = load_file(str(path / exports.ADAPTER_WEIGHTS))
        save_file({k.replace(old, new): v for k, v in tensors.items()}, str(path / exports.ADAPTER_WEIGHTS))
    return edit


REFUSALS = {
    "ia3": (_ia3, "--adapter: {a} holds a IA3Config, only LoRA exports"),
    "dora": (_config(use_dora=True), "--adapter: {a} uses DoRA or LoRA biases, which these exports do not support"),
    "lora-bias": (_config(lora_bias=True), "--adapter: {a} uses DoRA or LoRA biases"),
    "missing": (_drop_b, "--adapter: {a} lacks 1 adapter tensors, e.g. " + f"{PEFT}{Q}.lora_B"),
    "another-layer": (_rename("layers.1.", "layers.7."),
                      ("--adapter: its module model.layers.7.self_attn.q_proj is not a module of the checkpoint {b} "
                       "(nor model.language_model.layers.7.self_attn.q_proj): an adapter of another model?")),
    "another-model": (_rename("model.layers.1.self_attn", "visual.blocks.0.attn"),
                      ("--adapter: its module visual.blocks.0.attn.q_proj is not a module of the checkpoint {b}: "
                       "an adapter of another model?")),
}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_an_adapter_the_exports_cannot_write_is_refused_naming_why(base, tmp_path, kind):
    edit, message = REFUSALS[kind]
    _adapter(tmp_path / "a", {Q: 4})
    edit(tmp_path / "a")
    for export in (lambda out: exports.export_merged(base(), tmp_path / "a", out, exports.RunFiles(None), _quiet),
                   lambda out: exports.export_for("vllm", base(), tmp_path / "a", out, exports.RunFiles(None), "x",
                                                  log=_quiet)):
        with pytest.raises(ValueError) as e:
            export(tmp_path / "out")
        assert str(e.value).startswith(message.format(a=tmp_path / "a", b=base())), str(e.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_an_existing_output_is_refused_and_a_stale_temporary_replaced(base, tmp_path):
    _adapter(tmp_path / "a", {Q: 4})
    (tmp_path / "m").mkdir()
    with pytest.raises(ValueError, match=r"^--merged: .*/m already exists \(choose a new directory\)$"):
        exports.export_merged(base(), tmp_path / "a", tmp_path / "m", exports.RunFiles(None), log=_quiet)
    with pytest.raises(ValueError, match=r"^--for: .*/m already exists \(choose a new directory\)$"):
        exports.export_for("vllm", base(), tmp_path / "a", tmp_path / "m", exports.RunFiles(None), "x", log=_quiet)
    assert list((tmp_path / "m").iterdir()) == []
    (tmp_path / ".tmp-n").mkdir()
    (tmp_path / ".tmp-n" / "left-by-a-killed-export").write_text("")
    exports.export_merged(base(), tmp_path / "a", tmp_path / "n", exports.RunFiles(None), log=_quiet)
    assert not (tmp_path / ".tmp-n").exists() and not (tmp_path / "n" / "left-by-a-killed-export").exists()


def test_a_trained_module_of_another_shape_is_refused(base, tmp_path):
    ckpt = tmp_path / "base"
    shutil.copytree(base(), ckpt)
    shard = _index(ckpt)["weight_map"][HEAD]
    tensors = load_file(str(ckpt / shard))
    tensors[HEAD] = tensors[HEAD][:1000].clone()
    save_file(tensors, str(ckpt / shard), metadata={"format": "pt"})
    _adapter(tmp_path / "a", {Q: 4}, saved={HEAD: torch.zeros(1024, 32)})
    with pytest.raises(ValueError, match=rf"^{shard}: lm_head.weight has shape \(1000, 32\), the trained module "
                                         r"\(1024, 32\)$"):
        exports.export_merged(ckpt, tmp_path / "a", tmp_path / "m", exports.RunFiles(None), log=_quiet)
    # the refusal came while the shards were written: nothing is left, the staging folder neither
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "base"]


# -- the files beside the weights ------------------------------------------------------------------------------------

def test_the_runs_tokenizer_and_template_replace_the_bases(base, tmp_path):
    ckpt = tmp_path / "base"
    shutil.copytree(base(), ckpt)
    (ckpt / "README.md").write_text("the base's card")
    (ckpt / "preprocessor_config.json").write_text("{}")  # a text model: no image processor in its exports
    tok = tmp_path / "tok"
    (tok / "additional_chat_templates").mkdir(parents=True)
    (tok / "tokenizer.json").write_text('{"run": true}')
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old", "model_max_length": 7}))
    (tok / "chat_template.json").write_text('{"chat_template": "old"}')
    (tok / "additional_chat_templates" / "tools.jinja").write_text("tools")
    (tok / "additional_chat_templates" / "tools.jinja").chmod(0o600)
    _adapter(tmp_path / "a", {Q: 4})
    run = exports.RunFiles(tok)
    own = exports.export_for("vllm", ckpt, tmp_path / "a", tmp_path / "own", run, "x", log=_quiet)["files"]
    new = exports.export_merged(ckpt, tmp_path / "a", tmp_path / "new", exports.RunFiles(tok, "{{ messages }}"),
                                log=_quiet)["files"]
    model = tmp_path / "own" / "model"
    assert sorted(own) == ["README.md", "additional_chat_templates/", "chat_template.json", "config.json",
                           "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert (model / "tokenizer.json").read_text() == '{"run": true}'
    assert (model / "README.md").read_text() == "the base's card"
    assert (model / "additional_chat_templates" / "tools.jinja").stat().st_mode & 0o777 == exports.new_file_mode()
    assert not (model / "chat_template.jinja").exists() and not (model / "preprocessor_config.json").exists()
    assert new.count("chat_template.jinja") == 1
    assert (tmp_path / "new" / "chat_template.jinja").read_text() == "{{ messages }}"
    assert json.loads((tmp_path / "new" / "tokenizer_config.json").read_text()) == {"model_max_length": 7}
    assert not (tmp_path / "new" / "chat_template.json").exists()
    assert not (tmp_path / "new" / "additional_chat_templates").exists()
    plain = exports.export_merged(ckpt, tmp_path / "a", tmp_path / "plain", exports.RunFiles(None), log=_quiet)
    assert (tmp_path / "plain" / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert "chat_template.jinja" in plain["files"]


def test_the_report_names_no_file_the_template_replaced(base, tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "chat_template.json").write_text('{"chat_template": "old"}')
    _adapter(tmp_path / "a", {Q: 4})
    report = exports.export_merged(base(), tmp_path / "a", tmp_path / "m", exports.RunFiles(tmp_path / "tok", "T"),
                                   log=_quiet)
    assert set(report["files"]) <= {p.name for p in (tmp_path / "m").iterdir()}


def test_use_template_leaves_one_template(tmp_path):
    (tmp_path / "chat_template.json").write_text('{"chat_template": "json"}')
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "c", "bos_token": "é"}))
    exports.use_template(tmp_path, "T")
    assert (tmp_path / "chat_template.jinja").read_text() == "T" and not (tmp_path / "chat_template.json").exists()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {"bos_token": "é"}
    bare = tmp_path / "bare"
    bare.mkdir()
    exports.use_template(bare, "U")  # no tokenizer_config.json, no chat_template.json: fine
    assert sorted(p.name for p in bare.iterdir()) == ["chat_template.jinja"]


# -- names and modes -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("folder, name", [("run", "run"), ("run/", "run"), ("my run (2)", "my-run-2"),
                                          ("a.b_c-d", "a.b_c-d"), ("--x--", "x"), ("über", "ber"), ("ü", "packtrain"),
                                          (".", "cwd-here")])
def test_adapter_name(tmp_path, monkeypatch, folder, name):
    (tmp_path / "cwd here").mkdir()
    monkeypatch.chdir(tmp_path / "cwd here")
    assert exports.adapter_name(Path(folder)) == name


def test_new_file_mode_reads_the_umask_without_changing_it(monkeypatch):
    previous = os.umask(0o027)
    try:
        assert exports.new_file_mode() == 0o640
        assert os.umask(0o027) == 0o027

        class Unreadable:
            def __init__(self, path):
                pass

            def read_text(self):
                raise OSError("no /proc")

        monkeypatch.setattr(exports, "Path", Unreadable)
        assert exports.new_file_mode() == 0o640
        assert os.umask(0o027) == 0o027
    finally:
        os.umask(previous)


def test_plain_modes_sets_every_file_below_and_follows_no_link(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    files = [tmp_path / "top.json", tmp_path / "d" / "e" / "deep.safetensors"]
    for f, mode in zip(files, (0o600, 0o755)):
        f.write_text("x")
        f.chmod(mode)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_text("y")
    outside.chmod(0o600)
    (tmp_path / "d" / "link").symlink_to(outside)
    exports.plain_modes(tmp_path)
    assert [f.stat().st_mode & 0o777 for f in files] == [exports.new_file_mode()] * 2
    assert outside.stat().st_mode & 0o777 == 0o600


def test_factor_dtype_is_the_factors_float32_at_least():
    def dtype(*pairs):
        return exports._factor_dtype({k: torch.zeros(1, dtype=d) for k, d in pairs})

    assert dtype(("m.lora_A.weight", torch.bfloat16), ("m.lora_B.weight", torch.bfloat16)) == torch.float32
    assert dtype(("m.lora_A.weight", torch.float64), ("m.lora_B.weight", torch.float32)) == torch.float64
    assert dtype(("m.lora_A.weight", torch.bfloat16), ("lm_head.weight", torch.float64)) == torch.float32
