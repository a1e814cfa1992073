"""Write the tiny vision-language processor (packtrain/assets/vlm/) and the VLM demo data (data/vlm_demo/).

Processor: the bundled text tokenizer plus Qwen's three vision tokens (<|vision_start|>, <|vision_end|>,
<|image_pad|>) and a chat template that renders image parts as Qwen's does; a Qwen2-VL image processor with 8-pixel
patches, temporal patch 2 and 2x2 merging, for images of 32-64 pixels a side.

Data: three rulebooks ("sign codes") each give every coloured shape a meaning word, differently; an item shows a
sign as an image of a coloured shape (sizes vary, so image grids vary; some items show two signs) or names it in
words, and the target is the meaning the rulebook gives it. Deterministic: the same files every run.

    python tools/data/make_vlm_demo.py
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "packtrain/assets/vlm"
DATA = REPO / "data/vlm_demo"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
# the bundled Qwen3.6-like template (image parts render as a vision block); maintained in that file
CHAT_TEMPLATE = (REPO / "packtrain/assets/tokenizer/chat_template.jinja").read_text()
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220)}
SHAPES = ["circle", "square", "triangle"]
MEANINGS = ["stop", "go", "wait", "left", "right", "up", "down", "slow", "fast"]
SIZES = [(32, 32), (32, 48), (48, 32), (64, 32), (48, 64)]  # (width, height): grids of 4 to 12 merged tokens


def write_processor() -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(str(REPO / "packtrain/assets/tokenizer"), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(ASSETS)
    proc = Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64})
    proc.save_pretrained(ASSETS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    print(f"saved the VLM processor to {ASSETS}: {len(tok)} tokens, vision token ids {ids}")


def draw(shape: str, colour: str, size: tuple[int, int], rng: random.Random) -> Image.Image:
    w, h = size
    im = Image.new("RGB", size, (235, 235, 235))
    d = ImageDraw.Draw(im)
    m = rng.randint(2, 5)
    box = (m, m, w - 1 - m, h - 1 - m)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "square":
        d.rectangle(box, fill=fill)
    else:
        d.polygon([(w // 2, m), (w - 1 - m, h - 1 - m), (m, h - 1 - m)], fill=fill)
    return im


def rulebook(name: str, table: dict) -> str:
    lines = [f"Sign code {name}. You read traffic signs for a delivery robot. Every sign is one coloured shape, "
             "shown as a picture or named in words. Answer with the meaning this code gives the sign, one word "
             "per sign, separated by a space when there are two signs. The meanings:"]
    for (colour, shape), meaning in sorted(table.items()):
        lines.append(f"- a {colour} {shape} means {meaning}.")
    lines.append("Other codes give the same signs other meanings: use this code only.")
    return "\n".join(lines)


def write_data(n_train: int = 150, n_eval: int = 30) -> None:
    rng = random.Random(0)
    (DATA / "images").mkdir(parents=True, exist_ok=True)
    signs = [(c, s) for c in COLOURS for s in SHAPES]
    books = {}
    for name in "ABC":
        meanings = rng.sample(MEANINGS, len(signs))
        books[name] = dict(zip(signs, meanings))
    counter = 0

    def image_of(sign) -> str:
        nonlocal counter
        counter += 1
        path = f"images/sign-{counter:04d}.png"
        draw(sign[1], sign[0], rng.choice(SIZES), rng).save(DATA / path)
        return path

    def example(i: int, book: str) -> dict:
        table = books[book]
        kind = rng.random()
        if kind < 0.25:  # text only: shares packs with the image examples
            sign = rng.choice(signs)
            return {"id": f"{book}-{i}", "system": rulebook(book, table),
                    "item": f"Sign: a {sign[0]} {sign[1]}. What does it mean?", "target": table[sign]}
        if kind < 0.45:  # two signs, two images
            a, b = rng.sample(signs, 2)
            return {"id": f"{book}-{i}", "system": rulebook(book, table), "images": [image_of(a), image_of(b)],
                    "item": "Two signs in a row. What do they mean?", "target": f"{table[a]} {table[b]}"}
        sign = rng.choice(signs)
        return {"id": f"{book}-{i}", "system": rulebook(book, table), "images": [image_of(sign)],
                "item": "What does this sign mean?", "target": table[sign]}

    for split, n, offset in (("train", n_train, 0), ("eval", n_eval, 10_000)):
        rows = [example(offset + i, "ABC"[i % 3]) for i in range(n)]
        (DATA / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {n_train} train / {n_eval} eval examples and {counter} images to {DATA}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    write_processor()
    write_data()
