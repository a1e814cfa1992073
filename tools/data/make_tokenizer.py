"""Train the small tokenizers of packtrain/assets on the demo data text.

- ``packtrain/assets/tokenizer/`` (the default): a byte-level BPE (any text encodes, nothing is ever unknown) with
  Qwen's three special tokens and a Qwen3.6-like chat template.
- ``--qwen-like`` -> ``packtrain/assets/qwen_tokenizer/``: a byte-level BPE that splits and merges as Qwen's does
  (Qwen's pre-tokenizer split rule, single digits, NFC; ``"\n\n"`` one token) with Qwen's special and added
  tokens (``<think>``, ``<tool_call>``, the vision tokens, ...), so tests meet the boundaries Qwen's tokenizer has:
  ``<think>\n`` + ``\n</think>`` tokenizes differently apart and joined. It is trained on the demo text rendered
  through the bundled chat template (think blocks, tool calls) and a few CJK lines.

Both are saved as transformers fast-tokenizer directories. The demo text has only a few hundred distinct words, so
the vocabulary stops growing well before the requested size; the real size is printed. Deterministic: the same
data gives the same files.

    python tools/data/make_demo_data.py && python tools/data/make_tokenizer.py
    python tools/data/make_tokenizer.py --qwen-like
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[2]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The Qwen3.6-like chat template, maintained by hand in the file it is saved to (tools, reasoning, tool calls and
# responses, enable_thinking; see the file's header); tests/data/test_chat.py checks its behaviours.
TEMPLATE_FILE = REPO / "packtrain/assets/tokenizer/chat_template.jinja"
# Qwen2/3/3.5's pre-tokenizer split rule (its tokenizer.json): contractions, letters with one leading non-letter,
# single digits, punctuation runs with their newlines, newline runs, spaces.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")
# Qwen's added tokens (after the BPE vocabulary, as in Qwen's): special ones, and the markup ones Qwen's tokenizer
# adds as non-special (they survive skip_special_tokens).
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
QWEN_MARKUP = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
CJK_LINES = ["请用一句话回答：奥斯陆今天暖和吗？", "红色是阿尔法，蓝色是贝塔，绿色是伽马。", "天気はどうですか。東京は晴れです。",
             "오늘 서울의 날씨는 맑습니다."]


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


def chat_texts(paths: list[Path]) -> list[str]:
    """Each demo example rendered by the bundled template whole (reasoning and a tool call) and as a prompt with
    thinking off (the empty think block): the think blocks and newline runs of chat data."""
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))  # transformers renders through one
    template = TEMPLATE_FILE.read_text()
    texts = []
    for path in paths:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            messages = [{"role": "system", "content": r["system"]}, {"role": "user", "content": r["item"]},
                        {"role": "assistant", "content": r["target"], "reasoning_content": r["item"],
                         "tool_calls": [{"type": "function", "function": {"name": "lookup",
                                                                          "arguments": {"word": r["item"]}}}]}]
            texts.append(fast.apply_chat_template(messages, tokenize=False, chat_template=template))
            texts.append(fast.apply_chat_template(messages[:2], tokenize=False, chat_template=template,
                                                  add_generation_prompt=True, enable_thinking=False))
    return sorted(set(texts))


def train_qwen_like(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_MARKUP])
    assert len(tok.encode("\n\n").ids) == 1, "the training text must make \\n\\n one token, as in Qwen's"
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", default=[str(REPO / "data/demo/train.jsonl"),
                                                      str(REPO / "data/demo/eval.jsonl")])
    parser.add_argument("--qwen-like", action="store_true", help="the Qwen-like tokenizer (packtrain/assets/"
                                                                     "qwen_tokenizer)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--vocab-size", type=int, default=None, help="2000; 1000 with --qwen-like (under the tiny "
                                                                     "test models' 1024 embedding rows)")
    args = parser.parse_args()

    paths = [Path(p) for p in args.data]
    if args.qwen_like:
        tok = train_qwen_like(demo_texts(paths) + chat_texts(paths) + CJK_LINES,
                              (args.vocab_size or 1000) - len(QWEN_SPECIAL) - len(QWEN_MARKUP))
        args.out = args.out or str(REPO / "packtrain/assets/qwen_tokenizer")
    else:
        tok = train(demo_texts(paths), args.vocab_size or 2000)
        args.out = args.out or str(REPO / "packtrain/assets/tokenizer")
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
