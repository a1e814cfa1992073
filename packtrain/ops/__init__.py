"""Operations at scale: what a 64-GPU run needs checked before step 0, and the evidence it leaves when it stops.

- :mod:`~packtrain.ops.nodes`: what every rank actually imports, compared across ranks (``packtrain check-nodes``).
- :mod:`~packtrain.ops.fla_tune`: FLA autotune winners pinned as ``default_config`` files (``pretune-fla``).
- :mod:`~packtrain.ops.watchdog`: stacks and GPU power of every rank when no step completes (``dump-stacks``).
- :mod:`~packtrain.run.harness`: one update on one pack, for ``smoke`` and ``pretune-fla``.
- :mod:`~packtrain.ops.wandb_mirror`: metrics.jsonl mirrored to Weights & Biases (optional).
- :mod:`~packtrain.ops.runtime`: :class:`RunOps`, the hooks a training process calls.

docs/operations.md has the pre-launch checklist.
"""
