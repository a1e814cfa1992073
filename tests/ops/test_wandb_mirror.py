"""The Weights & Biases mirror (packtrain/ops/wandb_mirror.py) on a stand-in wandb module: each record under its
split's prefix at its step, only numbers (never the step, the split, a bool or a string), the run id kept in the
output directory so a resumed run continues the same wandb run. RunOps driving it as the trainer does:
tests/ops/test_runtime.py."""

import sys
import types

import pytest

from packtrain.ops.wandb_mirror import WandbMirror, require_wandb


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished, self.ids = [], [], 0, iter(["first", "second"])
        self.util = types.SimpleNamespace(generate_id=lambda: next(self.ids))

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda values, step: self.logged.append((step, values)),
                                     finish=lambda: setattr(self, "finished", self.finished + 1))


@pytest.fixture
def fake(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


def test_records_go_under_their_split_with_numbers_only(fake, tmp_path):
    mirror = WandbMirror("offline", "proj", tmp_path / "run", {"lr": 1})
    mirror.log({"step": 3.0, "loss": 1.5, "examples": 4, "finite": True, "note": "x", "grad_norm": None})
    mirror.log({"split": "eval", "step": 4, "loss": 2.0})
    mirror.log({"split": None, "step": 5, "lr": 1e-3})
    mirror.close()
    assert fake.logged == [(3, {"train/loss": 1.5, "train/examples": 4}), (4, {"eval/loss": 2.0}),
                           (5, {"train/lr": 1e-3})]
    assert isinstance(fake.logged[0][0], int) and fake.finished == 1
    init = fake.inits[0]
    assert (init["project"], init["mode"], init["dir"], init["name"], init["config"], init["resume"]) == (
        "proj", "offline", str(tmp_path / "run"), "run", {"lr": 1}, "allow")


def test_a_resumed_run_continues_the_same_wandb_run(fake, tmp_path):
    WandbMirror("offline", "proj", tmp_path / "run", {})
    WandbMirror("offline", "proj", tmp_path / "run", {})
    assert [i["id"] for i in fake.inits] == ["first", "first"]
    assert (tmp_path / "run" / "wandb-run-id").read_text() == "first\n"
    WandbMirror("offline", "proj", tmp_path / "other", {})
    assert fake.inits[2]["id"] == "second"


def test_wandb_asked_for_but_not_installed_names_the_setting(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match=r"^logging.wandb=online but the wandb package is not installed"):
        require_wandb("online")
