"""A run's recorded --set overrides: read, combined with a resume's own, written again."""

import pytest

from packtrain.rundir import overrides
from packtrain.rundir.directory import RunDirError
from packtrain.rundir.overrides import RunOverrides


def test_a_key_given_again_replaces_the_recorded_one_and_the_rest_are_kept():
    runs = overrides.combine(["train.max_steps=18", "optim.lr=0.1", "lora.r=4"], ["optim.lr = 0.2"])
    assert runs.kept == ["train.max_steps=18", "lora.r=4"] and runs.given == ["optim.lr = 0.2"]
    assert runs.all == ["train.max_steps=18", "lora.r=4", "optim.lr = 0.2"]  # the given ones last: they win
    assert runs.describe() == ("--set train.max_steps=18 (kept from the run's start), lora.r=4 (kept from the run's "
                               "start), optim.lr = 0.2 (given now)")
    assert RunOverrides().describe() is None


def test_the_record_round_trips_and_a_missing_one_is_empty(tmp_path):
    assert overrides.read(tmp_path) == []
    overrides.write(tmp_path, RunOverrides(["a.b=1"], ["c.d=x=y"]))
    assert overrides.read(tmp_path) == ["a.b=1", "c.d=x=y"]
    assert [p.name for p in tmp_path.iterdir()] == [overrides.FILE]  # no temporary left


@pytest.mark.parametrize("text,says", [("[1", "not valid JSON"), ('{"a": 1}', "expected a list"),
                                       ('["no equals sign"]', "expected a list")])
def test_a_damaged_record_is_refused_naming_the_file(tmp_path, text, says):
    (tmp_path / overrides.FILE).write_text(text)
    with pytest.raises(RunDirError, match=says) as e:
        overrides.read(tmp_path)
    assert str(tmp_path / overrides.FILE) in str(e.value)
