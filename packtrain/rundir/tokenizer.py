"""``OUTPUT/tokenizer/``: the tokenizer a run trained with, as every export carries it.

The tokenizer's files (``data.tokenizer``, else ``model.path``'s, else the bundled one) copied byte for byte, with the
chat template the run rendered its examples with: ``data.chat_template`` where set, in place of the tokenizer's own
(a model served with the tokenizer's own template reads prompts it never trained on). For a vision-language model
the image processor's files too. Written by rank 0 when a run starts; ``packtrain export`` reads it, and for a run
directory written before it existed falls back to the config's paths.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from packtrain.config import Config
from packtrain.data.chat import read_template
from packtrain.data.images import BUNDLED_PROCESSOR, PROCESSOR_FILES
from packtrain.data.jsonl import TOKENIZER_FILES, chat_template_of, processor_dir, tokenizer_dir
from packtrain.models.exports import RunFiles, use_template

FOLDER = "tokenizer"


def _copy_files(source: Path, target: Path, names) -> None:
    for name in names:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    extra = source / "additional_chat_templates"
    if "chat_template.jinja" in names and extra.is_dir():
        shutil.copytree(extra, target / extra.name, dirs_exist_ok=True)


def save_run_tokenizer(cfg: Config, out: Path, vision_language: bool) -> Path | None:
    """Write ``out/tokenizer`` (replacing a previous one, through a temporary name); returns it, or None where the
    run reads no tokenizer (pretokenized data on a model.path without one)."""
    source = tokenizer_dir(cfg)
    if not any((source / name).is_file() for name in TOKENIZER_FILES):
        return None
    folder, tmp = out / FOLDER, out / f".tmp-{FOLDER}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _copy_files(source, tmp, TOKENIZER_FILES)
    template = chat_template_of(cfg)
    if template is not None:
        shutil.rmtree(tmp / "additional_chat_templates", ignore_errors=True)
        use_template(tmp, read_template(template))
    if vision_language:
        _copy_files(processor_dir(cfg) or BUNDLED_PROCESSOR, tmp, PROCESSOR_FILES)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def run_files(out: Path) -> RunFiles | None:
    """What an export of the run in ``out`` carries (None: a run directory without ``tokenizer/``)."""
    folder = Path(out) / FOLDER
    if not folder.is_dir():
        return None
    return RunFiles(tokenizer=folder, processor=folder)
