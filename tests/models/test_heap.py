"""CPU training keeps glibc's heap between steps (packtrain.models.loading.keep_heap_between_steps, set by
assemble on the CPU): a step's large activations are served from memory the last step used, not mapped
and faulted in anew. Measured in a fresh process, as minor page faults around repeated 20 MiB allocations: first
without assemble, then with it (what it sets cannot be taken back, so it comes second)."""

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, resource, sys, torch
from packtrain.models.loading import fix_mmap_threshold


def faults():  # five steps, each writing a fresh 20 MiB tensor and freeing it
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        x = torch.ones(5 * 2**20)
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def measure(prepare):
    fix_mmap_threshold()  # what loading a checkpoint sets: every allocation above 128 KiB mapped on its own
    loading = faults()
    if prepare:
        from packtrain.bench.presets import get_preset
        from packtrain.config import config_from_dict
        from packtrain.models.build import build_base_model
        from packtrain.models.wrap import assemble

        cfg = config_from_dict(get_preset("tiny").config, source="test")
        assemble(build_base_model(cfg), cfg, torch.device(sys.argv[1]), training=False)
    faults()  # the heap grows once
    return {"loading": loading, "steps": faults()}


print(json.dumps({"untouched": measure(False), "prepared": measure(True)}))
"""


@pytest.mark.process  # page faults of a fresh process: this one's heap holds whatever earlier tests left
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_cpu_training_keeps_the_heap_between_steps():
    pages = 20 * 2**20 // 4096
    out = subprocess.run([sys.executable, "-c", SCRIPT, "cpu"], capture_output=True, text=True, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    untouched, cpu = measured["untouched"], measured["prepared"]
    assert untouched["steps"] >= 4 * pages, untouched  # without assemble the loading threshold stays
    assert cpu["loading"] >= 4 * pages, cpu  # the check can fail: mapped anew every time before
    assert cpu["steps"] < pages // 4, cpu
