"""`packtrain check-nodes CONFIG`, under the training launcher: every rank reports what it imports; rank 0 prints
one table; any difference (in what they import, or in their resolved config and data) exits 2 on every rank,
naming the field or config key and the ranks on each side, and so does a dependency version outside the tested ranges
(:mod:`packtrain.versions`), after the table (:mod:`packtrain.ops.nodes`). ``packtrain train`` runs the same check before step 0 unless ``ops.check_nodes: false``.
"""

from __future__ import annotations

from packtrain.config import load_config
from packtrain.distributed import init_distributed, shutdown
from packtrain.ops.nodes import check_nodes


def run_check_nodes(args) -> int:
    cfg = load_config(args.config, args.overrides)
    try:  # a failure inside init_distributed, once its group is up, still destroys the group
        info = init_distributed(cfg.train.device, cfg.ops.collective_timeout, refuse_versions=False)
        check_nodes(info, cfg=cfg)
    finally:
        shutdown()
    return 0
