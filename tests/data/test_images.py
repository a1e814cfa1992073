"""Examples with images: parsing, token counts, clear errors, and a short run of the real CLI (in this process)."""

import json
import shutil

import pytest
from cli_helpers import REPO, run_in_process
from PIL import Image

from packtrain.data.images import BUNDLED_PROCESSOR, load_image_processor
from packtrain.data.jsonl import DataError, load_examples
from packtrain.data.planner import plan_packs

VLM = str(BUNDLED_PROCESSOR)
IMAGE_PAD = 816  # <|image_pad|> in the bundled VLM tokenizer


def _image(path, size):
    Image.new("RGB", size, (200, 30, 30)).save(path)
    return path.name


def _write(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_and_chat_images_become_image_token_blocks(tmp_path):
    a = _image(tmp_path / "a.png", (32, 48))  # 32 x 48 pixels -> patch grid (1, 6, 4) -> 6 merged tokens
    b = _image(tmp_path / "b.png", (64, 32))  # -> (1, 4, 8) -> 8 tokens
    rows = [
        {"id": "t", "system": "Rules.", "item": "Look:", "target": "go", "images": [a, b]},
        {"id": "plain", "system": "Rules.", "item": "No picture.", "target": "stop"},
    ]
    text = load_examples(_write(tmp_path, rows), tokenizer=VLM, processor=VLM)
    assert [r.grid_thw for r in text[0].images] == [(1, 6, 4), (1, 4, 8)]
    assert text[0].item_ids.count(IMAGE_PAD) == 6 + 8
    assert text[1].images == () and IMAGE_PAD not in text[1].item_ids
    assert text[0].prefix_ids == text[1].prefix_ids  # P stays text-only and shared

    chat = [{"id": "c", "messages": [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": [{"type": "image", "image": a}, {"type": "image", "image": b},
                                     {"type": "text", "text": "Look:"}]},
        {"role": "assistant", "content": "go"}]}]
    (c,) = load_examples(_write(tmp_path, chat), tokenizer=VLM, processor=VLM)
    assert c.item_ids == text[0].item_ids and c.target_ids == text[0].target_ids  # the same rendering

    # the planner counts image tokens as positions
    plan = plan_packs(text, token_budget=10_000, max_continuations=10)
    assert plan.packs[0].positions == len(text[0].prefix_ids) + sum(len(e.item_ids) + len(e.target_ids)
                                                                    for e in text)


@pytest.mark.parametrize("row,field,message", [
    ({"system": "R", "item": "x", "target": "y", "images": ["missing.png"]}, "images[0]", "image not found"),
    ({"system": "R", "item": "x", "target": "y", "images": ["broken.png"]}, "images[0]", "cannot read image"),
    ({"system": "R", "item": "x", "target": "y", "images": "a.png"}, "images", "list of image paths"),
    ({"messages": [{"role": "system", "content": [{"type": "image", "image": "a.png"}]},
                   {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "messages[0].content",
     "text-only"),
    ({"messages": [{"role": "system", "content": "R"}, {"role": "user", "content": [{"type": "video"}]},
                   {"role": "assistant", "content": "y"}]}, "messages[1].content[0]", "expected"),
])
def test_bad_images_name_file_line_and_field(tmp_path, row, field, message):
    _image(tmp_path / "a.png", (32, 32))
    (tmp_path / "broken.png").write_bytes(b"not a png")
    good = {"system": "R", "item": "ok", "target": "y"}
    if "messages" in row:  # the same format on both lines
        good = {"messages": [{"role": "system", "content": "R"}, {"role": "user", "content": "x"},
                             {"role": "assistant", "content": "y"}]}
    path = _write(tmp_path, [good, row])
    with pytest.raises(DataError) as e:
        load_examples(path, tokenizer=VLM, processor=VLM)
    assert e.value.line == 2 and e.value.field == field and message in str(e.value)
    assert str(path) in str(e.value)


def test_images_need_a_vision_tokenizer(tmp_path):
    _image(tmp_path / "a.png", (32, 32))
    path = _write(tmp_path, [{"system": "R", "item": "x", "target": "y", "images": ["a.png"]}])
    with pytest.raises(ValueError, match="image_pad"):
        load_examples(path, processor=VLM)  # the bundled text tokenizer has no vision tokens


def test_bundled_processor_loads():
    proc = load_image_processor(None)
    assert proc.merge_size == 2 and proc.patch_size == 8


def test_vlm_cli_trains_and_evaluates(tmp_path):
    """Two steps of the VLM demo config on a slice of its data, then `packtrain eval` on the adapter."""
    data = tmp_path / "vlm"
    shutil.copytree(REPO / "data" / "vlm_demo" / "images", data / "images")
    for split, n in (("train", 12), ("eval", 4)):
        lines = (REPO / "data" / "vlm_demo" / f"{split}.jsonl").read_text().splitlines()[:n]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    cfg = str(REPO / "configs" / "vlm_demo.yaml")
    sets = ["--set", f"data.train={data / 'train.jsonl'}", "--set", f"data.eval={data / 'eval.jsonl'}",
            "--set", f"output_dir={tmp_path / 'run'}", "--set", "train.max_steps=2", "--set", "logging.progress=false"]
    out = run_in_process("train", cfg, *sets)
    assert "eval loss:" in out.stdout
    run_in_process("eval", cfg, *sets, "--adapter", tmp_path / "run" / "adapter", "--out", tmp_path / "e.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["loss"] > 0 and r["target_tokens"] > 0 for r in rows)
