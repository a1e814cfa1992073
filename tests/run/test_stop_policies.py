"""The small policy modules in process: StopSignals only records a signal (the first one), restore puts the old
handlers back; the finite check's verdict and its message."""

import math
import os
import signal

from packtrain.config import config_from_dict
from packtrain.run.finite import is_finite, stop_message
from packtrain.run.signals import StopSignals


def test_a_signal_is_recorded_not_acted_on_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    stops = StopSignals()
    stops.install()
    try:
        assert not stops.requested
        os.kill(os.getpid(), signal.SIGTERM)  # the default action would end this process
        os.kill(os.getpid(), signal.SIGINT)  # the default would raise KeyboardInterrupt
        assert stops.requested and stops.name() == "SIGTERM"  # the first one is the one reported
    finally:
        stops.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_finite_verdict_and_message():
    assert is_finite(1.0, 0.5) and not is_finite(1.0, math.nan) and not is_finite(math.inf, 0.5)
    cfg = config_from_dict({"optim": {"lr": 1e20}, "model": {"dtype": "bfloat16"}})
    msg = stop_message(7, math.nan, math.inf, cfg, "run/checkpoints/step-6", skips=0)
    assert msg.startswith("step 7: loss nan, gradient norm inf")
    for part in ("run/checkpoints/step-6, is intact", "optim.lr (now 1e+20)", "model.dtype float32",
                 "--resume --set train.max_nonfinite_skips=N"):
        assert part in msg, part
    assert "no checkpoint was written yet" in stop_message(1, math.nan, 0.0, cfg, None, skips=0)
