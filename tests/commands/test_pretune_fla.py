"""`packtrain pretune-fla`'s own logic (packtrain/commands/pretune_fla.py): the table of pinned configs it prints and
its refusal to run with fla's config cache on. The tuning itself runs on a GPU (tests/ops/test_fla_tune.py)."""

import pytest
import torch

from packtrain.commands import pretune_fla
from packtrain.ops import fla_tune
from packtrain.packed import kernels


def test_the_table_lists_each_kernel_its_keys_and_the_pinned_winner():
    tuned = {"chunk_o": {(16, "bf16"): fla_tune.config_entry({"BT": 32}, 4, 2),
                         (48, "bf16"): fla_tune.config_entry({"BT": 64}, 8, 3),
                         (48, "f32"): fla_tune.config_entry({"BT": 64}, 8, 3)},
             "a_l2norm": {(128,): fla_tune.config_entry({"BT": 16}, 2, 1)}}
    assert pretune_fla.format_tuned(tuned, []).splitlines() == [
        f"  {'kernel':<34} {'keys tuned':>10}  pinned config",
        f"  {'a_l2norm':<34} {1:>10}  {{'BT': 16}} warps 2 stages 1 (key [128])",
        f"  {'chunk_o':<34} {3:>10}  {{'BT': 64}} warps 8 stages 3 (key [48, 'f32'])"]  # two keys agree on BT 64
    assert pretune_fla.format_tuned(tuned, ["fused_a", "fused_b"]).splitlines()[-1] == (
        "  tuned by plain triton.autotune, which FLA's cache cannot pin: fused_a, fused_b")


@pytest.fixture
def gpu_and_fla(monkeypatch):
    """The checks pass on the machine: CUDA and fla present."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "fla_available", lambda: True)


@pytest.mark.parametrize("mode", ["default", "fullcache"])
def test_fla_reading_its_configs_is_refused_so_that_triton_searches(gpu_and_fla, monkeypatch, mode):
    monkeypatch.setenv(fla_tune.ENV_MODE, mode)
    with pytest.raises(ValueError, match=f"^FLA_CACHE_MODE={mode}: unset it for pretune-fla"):
        pretune_fla._require_gpu_and_fla()


def test_fla_cache_off_or_unset_is_accepted(gpu_and_fla, monkeypatch):
    monkeypatch.setenv(fla_tune.ENV_MODE, "disabled")
    pretune_fla._require_gpu_and_fla()
    monkeypatch.delenv(fla_tune.ENV_MODE)
    pretune_fla._require_gpu_and_fla()


@pytest.mark.parametrize("cuda, fla", [(False, True), (True, False)])
def test_without_cuda_or_fla_it_is_refused(monkeypatch, cuda, fla):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(kernels, "fla_available", lambda: fla)
    monkeypatch.delenv(fla_tune.ENV_MODE, raising=False)
    with pytest.raises(ValueError, match="^pretune-fla needs a CUDA GPU and the fla package"):
        pretune_fla._require_gpu_and_fla()
