"""Trainer behaviour in-process: the zero-gradient guard and split-independent loss normalisation."""

import pytest
import torch
from cli_helpers import write_config
from peft import get_peft_model_state_dict

from packtrain.config import load_config
from packtrain.packed.lm import PackedLM
from packtrain.packed.loss import ZeroGradientError
from packtrain.run.trainer import Trainer


def _trainer(tmp_path, *overrides, name="cfg.yaml"):
    cfg = load_config(write_config(tmp_path, name=name), list(overrides))
    return Trainer(cfg, log=lambda *a: None)


@pytest.mark.parametrize("cut,message", [
    (lambda h: h.detach() + 0.0 * h, "every trainable gradient is zero"),  # a graph, but zero gradients
    (lambda h: h.detach(), "does not require grad"),  # no graph at all
], ids=["zero-gradients", "no-graph"])
def test_zero_gradient_guard_fires_when_adapters_are_cut_off(tmp_path, monkeypatch, cut, message):
    original = PackedLM.hidden_states
    monkeypatch.setattr(PackedLM, "hidden_states", lambda self, layout, pack=None: cut(original(self, layout, pack)))
    trainer = _trainer(tmp_path, "data.eval=null", "train.max_steps=2")
    with pytest.raises(ZeroGradientError, match=message):
        trainer.train()


def test_guard_is_quiet_on_a_healthy_run(tmp_path):
    summary = _trainer(tmp_path, "data.eval=null", "train.max_steps=1").train()
    assert summary["steps"] == 1


def test_update_does_not_depend_on_how_a_step_is_split_into_packs(tmp_path):
    """All 15 examples in one step, packed three different ways: one adapter."""
    adapters, packs = [], []
    for i, (budget, max_cont) in enumerate([(1000, 90), (208, 3), (137, 1)]):
        trainer = _trainer(tmp_path, "data.eval=null", "train.max_steps=1", "train.packs_per_step=100",
                           f"packing.token_budget={budget}", f"packing.max_continuations={max_cont}",
                           "optim.name=sgd", "optim.max_grad_norm=null", f"output_dir={tmp_path / str(i)}")
        packs.append(len(trainer.plan.packs))
        trainer.train()
        adapters.append(get_peft_model_state_dict(trainer.model))
    assert packs == [3, 6, 15]  # three different splits of the same 15 examples
    for other in adapters[1:]:
        for name, value in adapters[0].items():
            torch.testing.assert_close(other[name], value, rtol=1e-9, atol=1e-12)


def test_the_run_keeps_the_users_config_and_records_the_savings_it_chose(tmp_path):
    """config.yaml holds the user's values (auto stays auto) and, beside them as comments, the savings the run
    chose; each checkpoint's state.json holds the same choice, and the model was assembled with it."""
    import json

    import yaml

    trainer = _trainer(tmp_path, "data.eval=null", "train.max_steps=2", "train.save_every=1",
                       "train.loss_chunk_rows=3")
    trainer.train()
    written = (tmp_path / "run" / "config.yaml").read_text()
    train = yaml.safe_load(written)["train"]
    assert train["activation_checkpointing"] == "auto" and train["offload"] == "auto", train  # as the user wrote
    assert train["loss_chunk_rows"] == 3
    chosen = trainer.savings.values()
    assert chosen["loss_chunk_rows"] == 3  # a value given is kept
    assert chosen["activation_checkpointing"] in (True, False) and chosen["offload"] != "auto", chosen
    comments = [line for line in written.splitlines() if line.startswith("#   train.")]
    assert comments == [f"#   train.{key}: {value}" for key, value in chosen.items()], written
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-1" / "state.json").read_text())
    assert state["savings"] == chosen and state["config"]["train"]["offload"] == "auto"
    assert trainer.lm.loss_chunk_rows == 3
