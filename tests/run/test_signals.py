"""StopSignals (packtrain/run/signals.py) in process: a signal is only recorded (the first one reported), and
restore puts the old handlers back."""

import os
import signal

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
