"""Train the small bundled tokenizer (packtrain/assets/tokenizer/) on the demo data text.

A byte-level BPE (any text encodes, nothing is ever unknown) with Qwen's three special tokens and a Qwen3.6-like
chat template, saved as a transformers fast-tokenizer directory. The demo text has only a few hundred
distinct words, so the vocabulary stops growing well before the requested size; the real size is printed.
Deterministic: the same data gives the same files.

    python tools/make_demo_data.py && python tools/make_tokenizer.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[1]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The Qwen3.6-like chat template, maintained by hand in the file it is saved to (tools, reasoning, tool calls and
# responses, enable_thinking; see the file's header); tests/test_chat.py checks its behaviours.
TEMPLATE_FILE = REPO / "packtrain/assets/tokenizer/chat_template.jinja"


def demo_texts(paths: list[Path]) -> list[str]:
    texts = []
    for path in paths:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            texts += [record["system"], record["item"], record["target"]]
    # The chat template's role names, so that each is one token rather than a run of byte pieces.
    texts += ["system\n", "user\n", "assistant\n"]
    return sorted(set(texts))  # each rulebook once: frequencies follow the distinct text, not the item count


def train(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", default=[str(REPO / "data/demo/train.jsonl"),
                                                      str(REPO / "data/demo/eval.jsonl")])
    parser.add_argument("--out", default=str(REPO / "packtrain/assets/tokenizer"))
    parser.add_argument("--vocab-size", type=int, default=2000)
    args = parser.parse_args()

    tok = train(demo_texts([Path(p) for p in args.data]), args.vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=1_000_000,
    )
    fast.chat_template = TEMPLATE_FILE.read_text()
    fast.save_pretrained(args.out)
    print(f"saved a {len(fast)}-token byte-level BPE to {args.out}")


if __name__ == "__main__":
    main()
