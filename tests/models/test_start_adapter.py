"""``model.adapter`` folded into the base (packtrain.models.start_adapter): the fold is peft's own merge (plain,
rsLoRA, rank and alpha patterns, an embedding, modules_to_save), the slices a rank reads fold to the slices of the
whole fold, and every adapter it cannot fold, or of another base, is refused naming what."""

import json
import math
import re

import pytest
import torch
from checkpoints import hf_model, save_checkpoint, text_config, vlm_config
from safetensors.torch import load_file, save_file

from packtrain.config import config_from_dict
from packtrain.models import start_adapter as sa
from packtrain.models.build import build_base_model
from packtrain.models.loading import SafetensorsCheckpoint, WeightMap

TARGETS = ["q_proj", "v_proj", "gate_proj", "in_proj_qkv", "embed_tokens"]


def _adapter(path, config=None, seed=1, **lora):
    """A peft adapter on ``hf_model(config)`` (float64), every factor random and the trained lm_head moved, saved
    to ``path``."""
    from peft import LoraConfig, get_peft_model

    model = hf_model(config or text_config()).double()
    torch.manual_seed(seed)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "modules_to_save": ["lm_head"],
                "init_lora_weights": False, **lora}
    peft_model = get_peft_model(model, LoraConfig(**settings))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "modules_to_save" in name:
                p.add_(torch.randn_like(p))
    peft_model.save_pretrained(path)
    return path


def _chain(path):
    return sa.read_chain(path, ["this base"], "the test's base")


def _peft_merged(path, config=None):
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(config or text_config()).double(), str(path)).merge_and_unload()


def _peft_merged_checkpoint(ckpt, path):
    from peft import PeftModel
    from transformers import Qwen3_5ForCausalLM

    base = Qwen3_5ForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    return PeftModel.from_pretrained(base, str(path)).merge_and_unload()


@pytest.mark.parametrize("lora", [{}, {"use_rslora": True},
                                  {"rank_pattern": {"q_proj": 2}, "alpha_pattern": {"v_proj": 3.0}}],
                         ids=["plain", "rslora", "patterns"])
def test_the_fold_is_peft_merge(tmp_path, lora):
    path = _adapter(tmp_path / "a", **lora)
    folded = sa.fold_base(hf_model(text_config()).double(), _chain(path))
    expected = dict(_peft_merged(path).named_parameters())
    touched = 0
    for name, p in folded.named_parameters():
        assert torch.equal(p, expected[name]), name
        touched += not torch.equal(p, dict(hf_model(text_config()).double().named_parameters())[name])
    assert touched == 2 + 3 + 2 + 1 + 1  # q, v (the attention layer), gate (3 layers), in_proj_qkv (2), embed, head
    changes = _chain(path).top.changes
    q = changes["model.layers.1.self_attn.q_proj"]
    if lora.get("use_rslora"):
        assert q.scaling == 8 / math.sqrt(4)
    elif lora.get("rank_pattern"):
        assert q.scaling == 8 / 2 and changes["model.layers.1.self_attn.v_proj"].scaling == 3.0 / 4
    else:
        assert q.scaling == 8 / 4


def test_a_ranks_slices_fold_as_the_whole(tmp_path):
    """What each rank reads (rows of a sharded tensor, in blocks) folds to the same slice of the whole fold."""
    ckpt = save_checkpoint(tmp_path / "ckpt", text_config(), dtype=torch.float64)
    path = _adapter(tmp_path / "a")
    cfg = config_from_dict({"model": {"path": str(ckpt), "dtype": "float64", "adapter": str(path)}})
    whole = dict(build_base_model(cfg).named_parameters())  # read whole, folded while read
    expected = dict(_peft_merged_checkpoint(ckpt, path).named_parameters())
    weights = WeightMap(build_base_model(cfg, meta=True), SafetensorsCheckpoint(ckpt))
    assert set(weights.fold.changes) >= {"lm_head.weight", "model.embed_tokens.weight"}
    for name in weights.fold.changes:
        assert torch.equal(whole[name], expected[name]), name
        rows, cols = whole[name].shape
        for r in range(0, rows, math.ceil(rows / 3)):
            for c in range(0, cols, math.ceil(cols / 2)):
                index = (slice(r, r + math.ceil(rows / 3)), slice(c, c + math.ceil(cols / 2)))
                assert torch.equal(weights.read(name, index), whole[name][index]), (name, index)


def test_a_random_base_is_saved_before_the_fold(tmp_path):
    path = _adapter(tmp_path / "a")
    raw = {"config": text_config(), "dtype": "float64"}
    folded = build_base_model(config_from_dict({"model": {**raw, "adapter": str(path)}}), save_to=tmp_path / "base")
    plain = build_base_model(config_from_dict({"model": raw}))
    saved = load_file(str(tmp_path / "base" / "model.safetensors"))
    assert all(torch.equal(saved[n], p) for n, p in plain.named_parameters() if n in saved)
    changed = [n for n, p in folded.named_parameters() if not torch.equal(p, dict(plain.named_parameters())[n])]
    assert "lm_head.weight" in changed and "model.layers.1.self_attn.q_proj.weight" in changed


def test_a_text_layout_adapter_folds_into_the_vision_language_class(tmp_path):
    path = _adapter(tmp_path / "a")
    fold = sa.Fold(_chain(path).links, hf_model(vlm_config()))
    assert "model.language_model.layers.1.self_attn.q_proj.weight" in fold.changes


def _edit(path, tensors=None, config=None):
    if tensors is not None:
        save_file(tensors, str(path / sa.WEIGHTS), metadata={"format": "pt"})
    if config is not None:
        (path / sa.CONFIG).write_text(json.dumps(config))


def _tensors(path):
    return load_file(str(path / sa.WEIGHTS))


Q_A = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"


def test_what_is_not_folded_is_refused_naming_it(tmp_path):
    model = hf_model(text_config())
    path = _adapter(tmp_path / "a")
    config = json.loads((path / sa.CONFIG).read_text())

    def refusal(**edit):
        _edit(path, **edit)
        with pytest.raises(ValueError) as e:
            sa.Fold(_chain(path).links, model)
        _edit(path, _tensors(tmp_path / "keep"), config)
        return str(e.value)

    (tmp_path / "keep").mkdir()
    _edit(tmp_path / "keep", _tensors(path))
    assert "use_dora True (DoRA) is not folded" in refusal(config={**config, "use_dora": True})
    assert "target_parameters" in refusal(config={**config, "target_parameters": ["mlp.experts.down_proj"]})
    assert "bias 'all'" in refusal(config={**config, "bias": "all"})
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in _tensors(path).items()}
    assert re.search(r"model\.layers\.7\.\S+\.lora_A\.weight names model\.layers\.7\.\S+, which is no module of this "
                     "model", refusal(tensors=renamed))
    wrong = {**_tensors(path), Q_A: torch.zeros(4, 40, dtype=torch.float64)}
    assert f"{Q_A} changes model.layers.1.self_attn.q_proj.weight as shape (128, 40), the model's is (128, 32)" in \
        refusal(tensors=wrong)
    stray = {**_tensors(path), "base_model.model.model.norm.weight": torch.ones(32, dtype=torch.float64)}
    assert "base_model.model.model.norm.weight is neither a LoRA factor nor a tensor of the modules_to_save" in \
        refusal(tensors=stray)
    alone = {k: v for k, v in _tensors(path).items() if "q_proj.lora_B" not in k}
    assert "has no lora_B beside it" in refusal(tensors=alone)
    magnitude = {**_tensors(path), "base_model.model.model.layers.1.self_attn.q_proj.lora_magnitude_vector":
                 torch.ones(64, dtype=torch.float64)}
    assert "lora_magnitude_vector is neither a LoRA factor" in refusal(tensors=magnitude)


def test_a_missing_or_damaged_adapter_is_one_line_naming_model_adapter(tmp_path):
    with pytest.raises(ValueError, match=f"model.adapter: {tmp_path / 'gone'} does not exist"):
        sa.read_link(tmp_path / "gone")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a PEFT adapter directory \\(no adapter_config.json\\)"):
        sa.read_link(tmp_path / "empty")
    path = _adapter(tmp_path / "a")
    data = (path / sa.WEIGHTS).read_bytes()
    (path / sa.WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"model.adapter: {path / sa.WEIGHTS}: unreadable"):
        sa.read_link(path)


def test_an_adapter_of_another_base_is_refused(tmp_path):
    path = _adapter(tmp_path / "a")
    assert "only its tensors' shapes were checked" in _chain(path).note  # another tool's, naming no local base
    other = save_checkpoint(tmp_path / "other", text_config(), seed=5)
    config = json.loads((path / sa.CONFIG).read_text())
    _edit(path, config={**config, "base_model_name_or_path": str(other)})
    with pytest.raises(ValueError, match=f"base_model_name_or_path {other} .* not this one, the test's base"):
        _chain(path)
    assert sa.read_chain(path, [sa.checkpoint_identity(other)], "other").note is None
    (path / sa.RECORD).write_text(json.dumps({"base": ["abc"], "base_name": "model.path /x", "start": None}))
    with pytest.raises(ValueError, match=r"trained on another base, model.path /x \(abc\), not this one, the test's "
                                         r"base \(this base\): refused"):
        _chain(path)


def test_a_chain_folds_each_start_and_refuses_a_changed_one(tmp_path):
    first, second = _adapter(tmp_path / "first", seed=1), _adapter(tmp_path / "second", seed=2)
    (first / sa.RECORD).write_text(json.dumps({"base": ["this base"], "start": None}))
    (second / sa.RECORD).write_text(json.dumps({"base": ["this base"], "start": {
        "path": str(first), "digest": sa.adapter_digest(first)}}))
    start = _chain(second)
    assert [link.dir for link in start.links] == [first, second]
    model = hf_model(text_config()).double()
    sa.fold_base(model, start)
    once = sa.fold_base(hf_model(text_config()).double(), _chain(first))
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(dict(model.named_parameters())[q],
                       start.top.changes["model.layers.1.self_attn.q_proj"].apply(dict(once.named_parameters())[q]))
    (first / sa.CONFIG).write_text((first / sa.CONFIG).read_text() + " ")
    with pytest.raises(ValueError, match=f"{second} was trained from the start adapter {first}, whose files changed"):
        _chain(second)


def test_the_dpo_reference_digest_holds_the_start(tmp_path):
    from packtrain.run import reference

    path = _adapter(tmp_path / "a")
    raw = {"config": text_config(), "dtype": "float64"}
    plain = reference.base_digest(config_from_dict({"model": raw}))
    started = reference.base_digest(config_from_dict({"model": {**raw, "adapter": str(path)}}))
    assert started != plain
    _edit(path, tensors={k: v * 2 for k, v in _tensors(path).items()})
    assert reference.base_digest(config_from_dict({"model": {**raw, "adapter": str(path)}})) != started


def test_an_adapter_without_a_base_is_a_config_problem():
    from packtrain.config.typed import ConfigError

    with pytest.raises(ConfigError, match="model.adapter: is folded into the base of model.path or model.config"):
        config_from_dict({"model": {"adapter": "sft/adapter"}})
