"""The README's snippet that tries the adapter with transformers + peft alone, run as a user runs it: a fresh
interpreter in this venv (fla installed, no GPU, no TRITON_INTERPRET), on a run packtrain trained. Before
`packtrain.use_torch_kernels_on_cpu()`, transformers called fla's kernels on CPU tensors and the forward failed with
"0 active drivers" (issue 28). Beside it, the configs the README and docs/objectives.md show load as configs."""

import os
import re
import subprocess
import sys

import pytest
from cli_helpers import REPO

pytestmark = pytest.mark.process


def _snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.DOTALL)
    found = [b for b in blocks if "PeftModel.from_pretrained" in b]
    assert len(found) == 1, "the README has one snippet that loads the adapter with peft"
    return found[0]


def test_the_readme_snippet_generates_with_transformers_and_peft(trained, tmp_path):
    run = trained().run
    code = _snippet()
    assert code.count('"runs/demo/') == 2
    script = tmp_path / "try_adapter.py"
    script.write_text(code.replace('"runs/demo/', f'"{run}/'))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True,
                          env={**env, "OMP_NUM_THREADS": "1"}, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("Encode: ") and " -> " in line and line.split(" -> ", 1)[1].strip(), proc.stdout


def _yaml_blocks(path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.DOTALL)


def test_the_readme_config_is_a_valid_config():
    """The README's annotated config loads as a packtrain config (every key known, every value allowed), read as
    packtrain reads a config file."""
    from packtrain.config import config_from_dict
    from packtrain.config.typed import load_yaml

    found = _yaml_blocks(REPO / "README.md")
    assert len(found) == 1, "the README has one config"
    cfg = config_from_dict(load_yaml(found[0]))
    assert (cfg.packing.mode, cfg.data.train_on) == ("shared_prefix", "last")


def test_the_objectives_page_preference_config_is_a_valid_dpo_config():
    """docs/objectives.md's ten-line preference config loads as a packtrain config (every key known, every value
    allowed) and asks for what its comments say."""
    import yaml

    from packtrain.config import config_from_dict

    found = [b for b in _yaml_blocks(REPO / "docs" / "objectives.md") if "objective: dpo" in b]
    assert len(found) == 1 and len(found[0].strip().splitlines()) == 10
    cfg = config_from_dict(yaml.safe_load(found[0]))
    t = cfg.train
    assert (t.objective, t.dpo_beta, t.dpo_loss_type, t.dpo_reference) == ("dpo", 0.1, "sigmoid", "precompute")
    assert cfg.packing.mode == "tree"


def test_the_objectives_page_grpo_settings_are_the_defaults_they_say():
    """docs/objectives.md's rl block loads as a packtrain config and its values are the rl section's defaults (the
    block documents them)."""
    import yaml

    from packtrain.config import RlConfig, config_from_dict

    found = [b for b in _yaml_blocks(REPO / "docs" / "objectives.md") if "objective: grpo" in b]
    assert len(found) == 1
    cfg = config_from_dict(yaml.safe_load(found[0]))
    assert cfg.train.objective == "grpo" and cfg.rl == RlConfig()


def test_the_quickstart_gives_each_commands_time_and_the_demo_needs_no_gpu_packages():
    """A newcomer reads how long each quickstart command takes on 2 cores, with the fast tier beside the suite; and
    `make demo` builds a venv without triton and fla (training on CPU needs neither), which `make test` adds."""
    quickstart = (REPO / "README.md").read_text().split("## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```")[0]
    commands = {line.split("#")[0].strip(): line.split("#", 1)[1] for line in quickstart.splitlines() if "#" in line}
    assert list(commands) == ["make demo", "make test-fast", "make test"]
    for command, says in commands.items():
        assert re.search(r"\d+(\.\d+)? (s|min) on 2 cores", says), (command, says)
    makefile = (REPO / "Makefile").read_text()
    (demo,) = re.findall(r"^demo: (\S+)$", makefile, flags=re.MULTILINE)
    variable = demo.strip("$()")
    (recipe,) = re.findall(rf"^\$\({variable}\): .*?\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    installs = [line for line in recipe.splitlines() if "pip install" in line]
    assert installs and not any("fla" in line or "triton" in line or "[" in line for line in installs), recipe
