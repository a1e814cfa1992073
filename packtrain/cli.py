"""`packtrain` command line: one subcommand per job. User errors print one message and exit 2, no traceback."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

from packtrain.config import MAX_GIB, MAX_POSITIONS
from packtrain.exits import RunStopped

MAX_RANKS = 2**20  # --world-size, --ranks-per-node


def whole(low: int, high: int):
    """An argparse type: a whole number in [low, high], else the flag is refused naming it (exit 2) before any
    work."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low:,} to {high:,}, got {text}")
        return value
    return parse


def amount(unit: str, high: float):
    """An argparse type: a finite number of ``unit`` above 0 and at most ``high`` (``nan`` would print JSON that is
    not JSON, ``inf`` an endless budget, and 0 or -1 mean nothing)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
        if not (math.isfinite(value) and 0 < value <= high):
            raise argparse.ArgumentTypeError(f"must be a finite number of {unit} above 0 and at most {high:,}, got "
                                             f"{text}")
        return value
    return parse


def _add_config_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("config", nargs="?" if optional else None, help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable); the value is parsed as YAML")


def _version() -> str:
    """packtrain's version: the package's own ``__version__``, else its installed metadata."""
    import packtrain

    version = getattr(packtrain, "__version__", None)
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            version = installed("packtrain")
        except PackageNotFoundError:
            version = "unknown (not installed)"
    return version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="packtrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"packtrain {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan packs for a config's training data and print the statistics")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--memory", action="store_true", help="also estimate per-GPU memory for the largest pack")
    p.add_argument("--world-size", type=whole(1, MAX_RANKS), default=None, metavar="N",
                   help="ranks sharing the weights (FSDP; default 1)")
    p.add_argument("--ranks-per-node", type=whole(1, MAX_RANKS), default=None, metavar="N",
                   help="with --memory: ranks on one node, whose offload pools share its host memory (default: "
                        "the world size up to 8; 1 with train.device cpu)")
    p.add_argument("--host-memory-per-node", type=amount("GiB", MAX_GIB), default=None, metavar="GIB",
                   help="with --memory: one node's host memory in GiB for the offload pools (default: "
                        "ops.host_memory_per_node_gib, else not limited); the savings chosen must fit it")
    p.add_argument("--measure", action="store_true",
                   help="with --memory: also run the training step under fake tensors (one layer of each kind) and "
                        "count its memory per phase")
    p.add_argument("--gpu-memory", type=amount("GiB", MAX_GIB), default=None, metavar="GIB",
                   help="with --memory: one GPU's memory in GiB: the savings left auto are chosen to fit it less "
                        "a reserve, and the largest packing.token_budget that fits it is given (default: 80 GiB "
                        "assumed, or the host's memory under train.device cpu)")

    p = sub.add_parser("train", help="train a LoRA adapter (single process, or under torchrun / accelerate launch)")
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--overwrite", action="store_true", help="remove a previous run's outputs from output_dir first "
                   "(adapter, checkpoints, metrics; listed as they go)")

    p = sub.add_parser("eval", help="per-example losses of an adapter on data.eval (or data.train); with --generate "
                       "its predictions, scored")
    _add_config_args(p)
    p.add_argument("--adapter", required=True, help="adapter directory (PEFT format), or `none` for the base model")
    p.add_argument("--out", required=True, help="output JSONL: one {id, loss, target_tokens} line per example; with "
                   "--generate one {id, prediction_ids, prediction, target, stop, score, match} line, and the "
                   "mismatches in FILE.errors.md")
    p.add_argument("--generate", action="store_true", help="generate each example's answer (P prefilled once per "
                   "prompt group; the generate: section of the config) and score it with generate.metric")

    p = sub.add_parser("check-nodes", help="compare what every rank imports (run under the training launcher)")
    _add_config_args(p)

    p = sub.add_parser("smoke", help="two updates on the largest pack, then a save: peak memory of each phase")
    _add_config_args(p)

    p = sub.add_parser("pretune-fla", help="tune fla's Triton kernels on a short update and pin the winners (GPU)")
    _add_config_args(p)
    p.add_argument("--prompt-tokens", type=whole(1, MAX_POSITIONS), default=8192, metavar="N",
                   help="cut P to N tokens (default 8192)")
    p.add_argument("--out", help="folder for the config files (default OUTPUT/fla-configs/<GPU name>)")

    p = sub.add_parser("dump-stacks", help="stacks and GPU status of a running job's processes on this host")
    _add_config_args(p, optional=True)
    p.add_argument("--pid", type=whole(1, 2**22), action="append", default=[], help="only this process (repeatable); "
                   "without CONFIG: py-spy on any process")

    p = sub.add_parser("bench", help="time shared-prefix (each packing.context_grad) vs prefix trees vs standalone vs "
                       "a plain transformers + peft loop on the same examples; table, bench.json and bench.png")
    _add_config_args(p, optional=True)
    p.add_argument("--preset", choices=["tiny", "cpu", "gpu", "tree", "dpo", "rl"],
                   help="config and data shape (default cpu; with CONFIG: "
                   "only the data shape, repeats and threads)")
    p.add_argument("--out", default="runs/bench", help="folder for bench.json and bench.png (default runs/bench)")
    p.add_argument("--repeats", type=whole(1, 10**6), help="timed epochs per variant (the median is reported)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="one untimed step of each variant before the timed repeats (default: on; CUDA: before the "
                        "memory pass, for compilation; CPU: after it, to grow the heap it released)")
    p.add_argument("--prompts", type=whole(1, 10**7), help="generated data: number of prompts")
    p.add_argument("--prefix-tokens", type=whole(1, MAX_POSITIONS), metavar="N",
                   help="generated data: tokens in each P")
    p.add_argument("--continuations", type=whole(1, 10**7), metavar="N",
                   help="generated data: continuations per prompt")
    p.add_argument("--cont-tokens", metavar="N|MIN:MAX", help="generated data: tokens per continuation")
    p.add_argument("--turns", metavar="N|MIN:MAX", help="generated data: every continuation a conversation of that "
                   "many turns of --cont-tokens each, every turn an example whose item is the history before its "
                   "answer (the tree preset's shape)")
    p.add_argument("--extra-continuations", action="append", metavar="COUNTxN|COUNTxMIN:MAX",
                   help="generated data: more continuations per prompt of other lengths (e.g. 1x1000: one long "
                   "one among the others); repeatable")
    p.add_argument("--peak-tflops", type=amount("TFLOP/s", 1e9), metavar="X",
                   help="device peak for MFU (CUDA default 989, the "
                   "H100/H200 bf16 dense datasheet figure)")
    p.add_argument("--threads", type=whole(1, 4096), metavar="N", help="torch CPU threads (default: 1 for the "
                   "cpu and tiny presets, else torch's choice)")
    p.add_argument("--variants", metavar="A,B,...", help="which to run (default all: shared_prefix, kv_only, "
                   "frozen, standalone, plain; kv_only/frozen are shared-prefix packs under packing.context_grad)")

    p = sub.add_parser("export", help="a run's adapter for serving: merged into its base checkpoint, or as a "
                       "server's adapter and the checkpoint to serve it on")
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="the output directory of a train run")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--merged", metavar="DIR", help="write the merged checkpoint here (a new directory)")
    what.add_argument("--for", dest="serve", nargs=2, metavar=("SERVER", "DIR"),
                      help="vllm or sglang: DIR/adapter (the LoRA part, in the server's reach) and DIR/model (the base "
                      "with the trained modules_to_save folded in), a new directory; prints the lines that serve them")
    p.add_argument("--server-version", metavar="X.Y", help="the server version the adapter is for (default: the "
                   "oldest whose rules packtrain read: vLLM 0.32, SGLang 0.5.23)")
    p.add_argument("--adapter", metavar="DIR", help="adapter to merge (default OUTPUT_DIR/adapter; e.g. a "
                   "checkpoints/step-N/adapter)")
    p.add_argument("--base", metavar="DIR", help="base checkpoint (default: model.path of OUTPUT_DIR/config.yaml, "
                   "or OUTPUT_DIR/base)")

    return parser


COMMANDS = {
    "plan": ("packtrain.commands.plan", "run_plan"),
    "train": ("packtrain.commands.train", "run_train"),
    "eval": ("packtrain.commands.eval", "run_eval"),
    "check-nodes": ("packtrain.commands.check_nodes", "run_check_nodes"),
    "smoke": ("packtrain.commands.smoke", "run_smoke"),
    "pretune-fla": ("packtrain.commands.pretune_fla", "run_pretune_fla"),
    "dump-stacks": ("packtrain.commands.dump_stacks", "run_dump_stacks"),
    "bench": ("packtrain.commands.bench", "run_bench"),
    "export": ("packtrain.commands.export", "run_export"),
}


def _quiet_library_noise(command: str) -> None:
    """transformers announces its slow fallbacks for the *unpacked* GDN kernels on every CPU run, and peft
    trips a deprecation warning: neither says anything about the packed path, whose back end we print."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    # fla (the `fla` extra) on a machine without a GPU says so at import; packtrain picks its kernels itself and
    # prints the choice in the run header
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")

    def not_fallback(record) -> bool:
        return "falling back to its reference PyTorch implementation" not in record.getMessage()

    # The messages come from child loggers and propagate to the library root's handler: filter there. Only
    # commands that load a model pay for importing transformers here.
    if command != "plan":
        from transformers.utils import logging as hf_logging

        root = hf_logging.get_logger("transformers")  # configures the library root and its handler
        for handler in root.handlers or logging.getLogger().handlers:
            handler.addFilter(not_fallback)
        root.addFilter(not_fallback)
        hf_logging.disable_progress_bar()  # "Writing model shards" for a model of a few MB
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


# Commands whose ranks meet under a launcher: there every rank checks the versions together once the group is up
# (packtrain.distributed.init_distributed), so that no rank refuses alone and leaves the others waiting.
COLLECTIVE = ("train", "eval", "smoke", "pretune-fla", "bench")
# check-nodes shows the versions against their ranges in its table and refuses after it; dump-stacks reads a
# running job's stacks, whatever it imports.
VERSIONS_SHOWN = ("check-nodes", "dump-stacks")


def _world_size() -> int:
    """The launcher's WORLD_SIZE (1 without one), refused in one line naming it when it is not a whole number."""
    text = os.environ.get("WORLD_SIZE", "1") or "1"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"WORLD_SIZE: expected a whole number of ranks (the launcher sets it), got {text!r}") from None


def _check_versions(command: str) -> None:
    """Refuse a dependency version outside the tested ranges (:mod:`packtrain.versions`) before any work, and before
    transformers is imported."""
    if command in VERSIONS_SHOWN or (command in COLLECTIVE and _world_size() > 1):
        return
    from packtrain.versions import check_versions

    check_versions()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, name = COMMANDS[args.command]
    if hasattr(sys.stdout, "reconfigure"):  # a log file gets each line as it is printed, not 8 KiB at a time
        sys.stdout.reconfigure(line_buffering=True)
    try:
        _check_versions(args.command)
        _quiet_library_noise(args.command)
        return getattr(importlib.import_module(module), name)(args)
    except ValueError as e:  # user errors: config, data, CLI arguments
        print(f"packtrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the checks before the work did not foresee: one line naming it, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"packtrain {args.command}: error: {where}{e.strerror or e} ({type(e).__name__})", file=sys.stderr)
        return 2
    except RunStopped as e:  # a deliberate stop (packtrain/exits.py): one line, its own exit code
        if not e.quiet:
            print(f"packtrain {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except RuntimeError as e:  # a collective whose peer died (its machine lost): a retryable stop, one line (train
        # says so itself, with what to resume)
        lost = _lost_peer(e)
        if lost is None:
            raise
        from packtrain.exits import PeerLost

        print(f"packtrain {args.command}: {lost}; run it again on every machine (exit {PeerLost.exit_code})",
              file=sys.stderr)
        return PeerLost.exit_code
    except KeyboardInterrupt:  # Ctrl-C before training started (during training it stops at a step boundary)
        print(f"packtrain {args.command}: interrupted", file=sys.stderr)
        return 130


def _lost_peer(e: RuntimeError) -> str | None:
    distributed = sys.modules.get("packtrain.distributed")  # only a command that started ranks has peers to lose
    return distributed.lost_peer(e) if distributed is not None else None


if __name__ == "__main__":
    raise SystemExit(main())
