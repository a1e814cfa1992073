"""``packtrain bench``: shared-prefix vs standalone vs a plain transformers + peft loop, on the same examples, in
one process, interleaved, against the planner's position ratio.

    presets.py   the tiny / cpu / gpu shapes and the generated data
    variants.py  the three training loops (same steps, same optimizer, same initial adapter)
    measure.py   interleaved timing, per-run peak memory, model FLOPs
    report.py    the table, bench.json and bench.png
"""
