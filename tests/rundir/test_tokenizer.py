"""OUTPUT/tokenizer/ (packtrain/rundir/tokenizer.py): the tokenizer a run reads, with the chat template it renders
its examples with in place of the tokenizer's own, and a vision-language model's image processor; nothing for a run
that reads no tokenizer."""

import json

from cli_helpers import REPO, write_config

from packtrain.config import load_config
from packtrain.data.jsonl import BUNDLED_TOKENIZER
from packtrain.rundir.tokenizer import run_files, save_run_tokenizer

CHATML = REPO / "data" / "demo" / "chatml.jinja"


def test_the_run_template_replaces_the_tokenizers_own(tmp_path):
    cfg = load_config(write_config(tmp_path, data={"chat_template": str(CHATML)}))
    folder = save_run_tokenizer(cfg, tmp_path / "out", vision_language=False)
    assert (folder / "chat_template.jinja").read_text() == CHATML.read_text()
    assert (BUNDLED_TOKENIZER / "chat_template.jinja").read_text() != CHATML.read_text()
    assert (folder / "tokenizer.json").read_bytes() == (BUNDLED_TOKENIZER / "tokenizer.json").read_bytes()
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    assert not (folder / "preprocessor_config.json").exists()
    files = run_files(tmp_path / "out")
    assert files.tokenizer == folder and files.chat_template is None  # the folder's own template is the run's


def test_without_data_chat_template_the_tokenizers_own_is_kept(tmp_path):
    cfg = load_config(write_config(tmp_path))
    folder = save_run_tokenizer(cfg, tmp_path / "out", vision_language=False)
    assert (folder / "chat_template.jinja").read_bytes() == (BUNDLED_TOKENIZER / "chat_template.jinja").read_bytes()


def test_a_vision_language_run_keeps_the_image_processor(tmp_path):
    cfg = load_config(REPO / "configs" / "vlm_demo.yaml")
    folder = save_run_tokenizer(cfg, tmp_path / "out", vision_language=True)
    processor = REPO / "packtrain" / "assets" / "vlm" / "preprocessor_config.json"
    assert (folder / "preprocessor_config.json").read_bytes() == processor.read_bytes()


def test_a_run_reading_no_tokenizer_writes_none(tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    cfg = load_config(write_config(tmp_path, data={"tokenizer": str(empty)}))
    assert save_run_tokenizer(cfg, tmp_path / "out", vision_language=False) is None
    assert run_files(tmp_path / "out") is None


def test_a_second_save_replaces_the_first(tmp_path):
    save_run_tokenizer(load_config(write_config(tmp_path, data={"chat_template": str(CHATML)})), tmp_path / "out",
                       vision_language=False)
    save_run_tokenizer(load_config(write_config(tmp_path)), tmp_path / "out", vision_language=False)
    assert (tmp_path / "out" / "tokenizer" / "chat_template.jinja").read_text() != CHATML.read_text()
    assert not (tmp_path / "out" / ".tmp-tokenizer").exists()
