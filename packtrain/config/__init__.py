"""packtrain's config: every section and key with its type and default, the bounds and the rules between keys, and
the loading of a YAML file with ``--set section.key=value`` overrides.

Every problem in a config (unknown key, wrong type, bad value) is collected and reported together, each with
its dotted path, in one :class:`ConfigError` (the typed tree: :mod:`packtrain.config.typed`; what
``data.template_kwargs`` may hold: :mod:`packtrain.config.templates`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from packtrain.config import support
from packtrain.config.templates import template_kwargs_problems
from packtrain.config.typed import ConfigError, apply_overrides, build, get_dotted, load_yaml, yaml_problem


@dataclass
class ModelConfig:
    path: str | None = None  # a local transformers directory (no downloads)
    config: dict | None = None  # or a transformers config dict, randomly initialised from `seed`
    seed: int = 0
    # A trained PEFT adapter directory (an SFT run's OUTPUT/adapter, say) folded into the base: the run trains a new
    # LoRA on base + this adapter, as if model.path were its `packtrain export --merged` (packtrain/models/start_adapter.py)
    adapter: str | None = None
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    # Kernels for the packed forward: torch (CPU reference, also runs on CUDA) or fla (CUDA: fla + FlexAttention;
    # CPU only under TRITON_INTERPRET=1). `auto` picks fla on CUDA when fla imports, else torch; always printed.
    kernels: Literal["auto", "torch", "fla"] = "auto"
    # Which fla kernel runs the packed delta rule: fla's own Triton kernel (tested against the torch reference), or
    # FlashQLA (fla dispatches to it on SM90/SM100 at K = V = 128 when flash_qla imports; opt-in: its dg had a
    # precision bug until 2026-07). Pinned either way (FLA_FLASH_QLA), printed in the run header.
    gdn_kernel: Literal["triton", "flash_qla"] = "triton"


@dataclass
class DataConfig:
    train: str | None = None
    eval: str | None = None
    format: Literal["text", "chat", "pretokenized"] | None = None  # auto-detected from the first line when None
    tokenizer: str | None = None  # a local tokenizer directory; default: model.path, else the bundled tokenizer
    # a local image-processor directory for examples with images; default: model.path if it has one, else the tiny
    # bundled one (packtrain/assets/vlm)
    processor: str | None = None
    # which assistant turns of a chat carry loss: last (the final one), all (every one, one example per
    # conversation) or each (one example per turn); packtrain/data/jsonl.py
    train_on: Literal["last", "all", "each"] = "last"
    # passed to every render of the chat template, e.g. {enable_thinking: false}
    template_kwargs: dict | None = None
    # a Jinja file that replaces the tokenizer's chat template (e.g. one that keeps history, for train_on: all)
    chat_template: str | None = None


@dataclass(frozen=True)
class WalkSpec:
    """The walk's settings as the walk uses them (packtrain/packed/walk.py, packtrain/data/walk_calls.py)."""
    chunk: int  # positions per chunk
    horizon: int | None  # tokens the gradient flows back before a chunk's start; None: all (exact)

    def describe(self) -> str:
        if self.horizon is None:
            return (f"walk (chunks of {self.chunk} on top of P, horizon all: exact, earlier chunks recomputed in "
                    "reverse)")
        return f"walk (chunks of {self.chunk} on top of P, horizon {self.horizon}: gradient cut {self.horizon} " \
               "tokens before each chunk)"


@dataclass
class WalkConfig:
    chunk: int = 2048  # positions per chunk of a walked example
    # tokens the gradient flows back before each chunk's start, or `all` (exact); packtrain/data/walk_calls.py
    horizon: int | Literal["all"] = "all"


@dataclass
class PackingConfig:
    # shared_prefix: packs of P + continuations; standalone: each example alone (the reference); tree: P + the
    # prefix tree of the pack's continuations, each shared run of tokens computed once (data/planner.py)
    mode: Literal["shared_prefix", "standalone", "tree"] = "shared_prefix"
    token_budget: int = 150_000  # positions per pack: len(P) + sum of continuation lengths
    max_continuations: int = 90
    # An example whose P + continuation alone exceeds the budget: error, skip (counted), or walk: trained chunk by
    # chunk on top of P with gradient horizon walk.horizon (packtrain/packed/walk.py)
    on_overflow: Literal["error", "skip", "walk"] = "error"
    walk: WalkConfig = field(default_factory=WalkConfig)
    # What the gradient does with the shared prefix P (packtrain/packed/context.py, docs/design.md): full = exact gradient
    # through P; kv_only = forward unchanged, gradient cut at P's rows of every decoder-layer input; frozen = P under
    # no_grad, continuations read its K/V, GDN state and conv tail as constants.
    context_grad: Literal["full", "kv_only", "frozen"] = "full"
    # Run each pack's continuations in this many groups against one P graph (packtrain/packed/groups.py): P's forward
    # once, each group's forward and backward in turn, then one backward through P. The same gradient; peak memory
    # holds P's graph and one group's instead of every continuation's. 1 = the whole pack in one forward.
    continuation_groups: int = 1


@dataclass
class LoraConfig:
    r: int = 8
    alpha: float = 16
    dropout: float = 0.05
    # The seed's choice for long inputs: no adapter on up_proj/down_proj (down_proj's adapter input is the
    # intermediate-wide activation; with the MLP in tiles it is kept one tile at a time).
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"])
    # Parameters adapted directly (peft's parameter targeting), for the routed experts of MoE families, e.g.
    # [mlp.experts.gate_up_proj, mlp.experts.down_proj]; needs dropout 0. The router (mlp.gate) stays frozen.
    target_parameters: list[str] = field(default_factory=list)
    init_lora_weights: bool | str = True
    modules_to_save: list[str] | None = None
    bias: Literal["none", "all", "lora_only"] = "none"
    use_rslora: bool = False


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 2.0e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    schedule: Literal["constant", "cosine"] = "constant"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1.0e-8
    momentum: float = 0.0  # sgd only
    max_grad_norm: float | None = 1.0  # None: no clipping (the norm is still logged)


@dataclass
class TrainConfig:
    # What the loss is (packtrain/run/objective.py): sft, each example's mean target cross-entropy; weighted, that
    # times the example's "weight"; dpo, per preference pair -log sigmoid(dpo_beta * ((logp_c - ref_c) - (logp_r -
    # ref_r))), logp the summed log-probabilities of an answer, ref the base model's (the adapter disabled)
    # grpo: a GRPO-family update on scored groups (the rl section)
    objective: Literal["sft", "dpo", "weighted", "grpo"] = "sft"
    dpo_beta: float = 0.1
    # sigmoid: the DPO loss above; ipo: (margin - 1 / (2 * dpo_beta))^2 on per-token mean log-probabilities (TRL's)
    dpo_loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    # The reference log-probabilities: precompute, one pass over the training data before step 0, cached in the
    # run directory (OUTPUT/reference.json, checked against the data, the base and the tokenizer); per_step, a
    # no-grad forward of each unit with the adapter disabled, before its training forward
    # dpo, and grpo's KL (rl.beta > 0) on the data's scored groups (online grpo: per_step only)
    dpo_reference: Literal["precompute", "per_step"] = "precompute"
    # dpo only: adds rpo_alpha times the chosen answer's mean target cross-entropy to each pair's loss (TRL's
    # rpo_alpha, the NLL term of RPO, arXiv 2404.19733): the chosen answers are also learnt as targets. 0: DPO alone
    rpo_alpha: float = 0.0
    epochs: int = 2
    max_steps: int | None = None
    # Packs each rank trains per optimizer step (TRL's and axolotl's per-device batch): a step holds packs_per_rank
    # x the world size packs, so every rank works
    packs_per_rank: int = 1
    # Or the step's packs over all ranks together (global, the same steps at any world size: what a resume on
    # another world size keeps); fewer than the ranks leaves ranks idle (warned at start). null: packs_per_rank
    packs_per_step: int | None = None
    seed: int = 0
    save_every: int = 100
    eval_every: int | None = None
    # The memory savings (packtrain/memory/savings.py): `auto` takes, at the start of train, smoke and bench (and in
    # `plan --memory`), the combination whose estimate for the largest unit fits the device's memory (less a
    # reserve) and the host's, with the least estimated step time; a value given is kept.
    # Each decoder layer recomputed in backward from its checkpointed input.
    activation_checkpointing: bool | Literal["auto"] = "auto"
    # Checkpointed layer inputs in host memory: true (every layer), false, or N (the first N layers; the rest stay
    # on the device); implies checkpointing. In backward each is copied back while the layer after it runs.
    offload: bool | int | Literal["auto"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    # A hard cap on positions per forward (a memory limit found by `packtrain smoke`), enforced at run time without
    # re-planning: a unit over it is skipped on every rank and counted. None: the packing budget is the cap.
    max_positions: int | None = None
    # Exception class names that skip a unit (on every rank, counted) instead of stopping the run, when raised
    # while the unit is built, before any collective of the step; e.g. [DataError].
    skippable_errors: list[str] = field(default_factory=list)
    # Steps whose loss or gradient norm is NaN/inf that are skipped (no update, counted in metrics.jsonl) before
    # the run stops (exit 4); 0: the first one stops it.
    max_nonfinite_skips: int = 0
    # Checkpoints kept after each successful save (the newest N); None: keep all.
    keep_checkpoints: int | None = 3
    # How an epoch's packs become steps (packtrain/run/balance.py): cost puts packs of similar cost into one step
    # and gives every rank the same number; round_robin cuts the shuffled order into steps, rank r taking r, r+world
    balance: Literal["cost", "round_robin"] = "cost"
    # The cost model's figures (None: from the model config, FLOPs); e.g. measured seconds per position and per
    # attention pair on the GPU
    cost_per_position: float | None = None
    cost_per_pair: float | None = None
    # Target rows per chunk of lm_head + cross-entropy: each chunk's logits are recomputed in backward, so nothing
    # larger than [rows, vocabulary] exists (packtrain/packed/loss.py); 0: all target rows at once, nothing
    # recomputed. The loss's peak is about 3 float32 [rows, vocabulary] (docs/performance.md, "Chunked loss").
    loss_chunk_rows: int | Literal["auto"] = "auto"
    # Buffer rows per tile of a forward's dense MLP, each tile recomputed in backward so that its [rows,
    # intermediate] activations live only while it runs; null: the device's default tile (packtrain/packed/kernels);
    # 0: whole.
    mlp_chunk_rows: int | None | Literal["auto"] = "auto"
    # Rows per tile of every RMSNorm (the gated norm too), recomputed in backward tile by tile so that its float32
    # pieces exist one tile at a time (packtrain/packed/recompute.py); a tile holds as many elements as that many
    # rows of the hidden state (a norm over a head's width takes more of its own rows); 0: whole, as transformers
    # runs it (autograd keeps its float32 copies).
    norm_chunk_rows: int | Literal["auto"] = "auto"


@dataclass
class GenerateConfig:
    """Generation on held-out examples (`packtrain eval --generate`, and during training with ``every``)."""
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy; above 0: sampled (with top_p) from generators seeded by `seed`
    top_p: float = 1.0
    seed: int = 0
    metric: str = "exact"  # exact | json | python:module:function (a scorer (prediction, target, example) -> [0, 1])
    strip_thinking: bool = True  # a <think>...</think> block is removed from the prediction before it is scored
    every: int | None = None  # during training: every N steps and at the end (None: never)
    examples: int | None = None  # the first N examples of data.eval (None: all of them)


@dataclass
class RlConfig:
    """``train.objective: grpo``: a GRPO-family update on scored groups (packtrain/run/rl.py; the names are TRL's
    GRPOConfig's): on scored groups from the data, or sampled online (``num_generations``;
    packtrain/run/rollouts.py)."""
    # grpo: the mean over the step's completions of each one's token mean; dr_grpo: the step's summed token terms /
    # (completions x max_completion_length); dapo and cispo: the step's summed token terms / its tokens. cispo's term:
    # -min(ratio, epsilon_high), detached, x A x log p
    loss_type: Literal["grpo", "dr_grpo", "dapo", "cispo"] = "dapo"
    # token: each token's own ratio; sequence: GSPO's exp(mean of the completion's log-ratios) for all its tokens
    importance_sampling_level: Literal["token", "sequence"] = "token"
    # group: A = (r - the group's mean) / (its std, Bessel-corrected, + 1e-4); none: r - the group's mean
    scale_rewards: Literal["group", "none"] = "group"
    epsilon: float = 0.2  # the ratio's clip below 1 - epsilon
    epsilon_high: float | None = None  # ... and above 1 + epsilon_high (None: epsilon); cispo's ceiling itself
    # The k3 estimate of the KL to the reference (the base, the adapter disabled: a no-grad forward of each unit
    # before its training forward), times beta, added per token. 0: no reference forward
    beta: float = 0.0
    max_completion_length: int = 256  # dr_grpo's divisor; online, the most tokens a completion samples
    # Online: K completions sampled per item each step (P prefilled once), scored by generate.metric against the
    # record's target, written to OUTPUT/rollouts/step-N.jsonl; data.train then holds requests with targets. None:
    # the data's scored groups
    num_generations: int | None = None
    temperature: float = 1.0  # online sampling's temperature (> 0)
    top_p: float = 1.0  # ... and its nucleus


@dataclass
class LoggingConfig:
    progress: bool = True  # a progress bar, on a terminal only (stderr a TTY)
    # Without the bar (a log file, a cluster job, progress false): one plain line every N steps (and at the first and
    # the last): step, loss, lr, positions/s, tokens seen, elapsed and ETA. null: none
    every: int | None = 10
    wandb: Literal["off", "offline", "online"] = "off"
    wandb_project: str = "packtrain"


@dataclass
class OpsConfig:
    # Compare what every rank imports (versions, paths, CUDA/NCCL, GPU, FLA cache) before step 0; a difference
    # refuses the run (`packtrain check-nodes` runs the same check by hand).
    check_nodes: bool = True
    # No completed step for this long: every rank writes its stacks to OUTPUT/hang/rank-N.txt. None: no watchdog.
    hang_timeout: float | None = 1800.0
    # After the stacks are written, this many more seconds without progress abort the process (exit 124) so a
    # scheduler can restart it with --resume. None: wait forever.
    hang_abort: float | None = 600.0
    # torch.distributed's timeout (seconds) for init_process_group's rendezvous and every collective. Longer than
    # hang_timeout + hang_abort, so the watchdog's stacks come first.
    collective_timeout: float = 3600.0
    # Host memory (GiB) the offload pools of one node's ranks may take together (train.offload): a run whose pools
    # would not fit is refused at start. None: the node's available memory (MemAvailable) at start.
    host_memory_per_node_gib: float | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    rl: RlConfig = field(default_factory=RlConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)
    output_dir: str = "runs/default"
    # Directory of the YAML file: every relative path of the config (PATHS: data, model, output_dir) is resolved
    # against it, whatever the working directory.
    base_dir: str = field(default=".", metadata={"internal": True})

    def resolve_path(self, p: str | None) -> Path | None:
        if p is None:
            return None
        path = Path(p).expanduser()
        return path if path.is_absolute() else Path(os.path.normpath((Path(self.base_dir) / path).absolute()))

    @property
    def output_path(self) -> Path:
        """``output_dir`` resolved against the config file's directory, as every other path is; a relative one is
        said relative to the working directory where it lies below it (``runs/demo/adapter`` in what a run prints)."""
        path = self.resolve_path(self.output_dir)
        if Path(self.output_dir).expanduser().is_absolute() or not path.is_relative_to(Path.cwd()):
            return path
        return path.relative_to(Path.cwd())

    def packs_per_step(self, world: int) -> int:
        """The packs of one optimizer step at ``world`` ranks: ``train.packs_per_step`` where given, else
        ``train.packs_per_rank`` on every rank."""
        t = self.train
        return t.packs_per_step if t.packs_per_step is not None else t.packs_per_rank * world

    def walk_spec(self) -> WalkSpec | None:
        """The walk's settings, None unless packing.on_overflow is walk."""
        w = self.packing.walk
        if self.packing.on_overflow != "walk":
            return None
        return WalkSpec(w.chunk, None if w.horizon == "all" else w.horizon)

    def to_dict(self, resolved: bool = False) -> dict:
        """The config as YAML holds it; ``resolved``: every path of :data:`PATHS` absolute, so that the dict
        written to a run directory (its ``config.yaml``) runs again from anywhere."""
        d = dataclasses.asdict(self)
        d.pop("base_dir")
        if resolved:
            for dotted in PATHS:
                *parents, key = dotted.split(".")
                where = d
                for part in parents:
                    where = where[part]
                if key in where and where[key] is not None:
                    where[key] = str(self.resolve_path(where[key]))
        return d


# Every key of the config that names a file or directory: relative ones resolve against the config file's directory.
PATHS = ("model.path", "model.adapter", "data.train", "data.eval", "data.tokenizer", "data.processor",
         "data.chat_template", "output_dir")


# Bounds checked after types: (dotted path, predicate, message).
_BOUNDS = [
    ("packing.token_budget", lambda v: v >= 2, "must be at least 2"),
    ("train.cost_per_position", lambda v: math.isfinite(v) and v >= 0, "must be a finite number, not negative"),
    ("train.cost_per_pair", lambda v: math.isfinite(v) and v >= 0, "must be a finite number, not negative"),
    ("packing.max_continuations", lambda v: v >= 1, "must be at least 1"),
    ("packing.walk.chunk", lambda v: v >= 1, "must be at least 1"),
    ("packing.continuation_groups", lambda v: v >= 1, "must be at least 1"),
    ("packing.walk.horizon", lambda v: v == "all" or v >= 0, "must be >= 0 tokens or all"),
    ("lora.r", lambda v: v >= 1, "must be at least 1"),
    ("train.dpo_beta", lambda v: v > 0, "must be positive"),
    ("train.rpo_alpha", lambda v: v >= 0, "must be >= 0 (0: DPO alone)"),
    ("rl.epsilon", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("rl.epsilon_high", lambda v: v is None or v >= 0, "must be >= 0 (or null: rl.epsilon)"),
    ("rl.beta", lambda v: v >= 0, "must be >= 0 (0: no KL term)"),
    ("rl.max_completion_length", lambda v: v >= 1, "must be at least 1"),
    ("rl.num_generations", lambda v: v is None or v >= 2,
     "must be at least 2 (a group's advantage compares its completions), or null: the data's scored groups"),
    ("rl.temperature", lambda v: v > 0, "must be > 0 (the completions of a group must differ)"),
    ("rl.top_p", lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("lora.dropout", lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    ("optim.lr", lambda v: v > 0, "must be positive"),
    ("optim.max_grad_norm", lambda v: v > 0, "must be positive (or null: no clipping)"),
    ("optim.warmup_steps", lambda v: v >= 0, "must be >= 0"),
    ("optim.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "must be two numbers in [0, 1)"),
    ("train.epochs", lambda v: v >= 1, "must be at least 1"),
    ("train.max_steps", lambda v: v is None or v >= 1, "must be at least 1 (or null)"),
    ("train.packs_per_rank", lambda v: v >= 1, "must be at least 1"),
    ("train.packs_per_step", lambda v: v is None or v >= 1, "must be at least 1 (or null: train.packs_per_rank)"),
    ("train.save_every", lambda v: v >= 1, "must be at least 1"),
    ("train.eval_every", lambda v: v is None or v >= 1, "must be at least 1 (or null)"),
    ("generate.max_new_tokens", lambda v: v >= 1, "must be at least 1"),
    ("generate.temperature", lambda v: v >= 0, "must be >= 0 (0: greedy)"),
    ("generate.top_p", lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("generate.every", lambda v: v is None or v >= 1, "must be at least 1 (or null)"),
    ("logging.every", lambda v: v is None or v >= 1, "must be at least 1 (or null: no step lines)"),
    ("generate.examples", lambda v: v is None or v >= 1, "must be at least 1 (or null: all)"),
    ("ops.hang_timeout", lambda v: v is None or v > 0, "must be positive (or null: no watchdog)"),
    ("ops.hang_abort", lambda v: v is None or v > 0, "must be positive (or null: never abort)"),
    ("ops.collective_timeout", lambda v: v > 0, "must be positive"),
    ("ops.host_memory_per_node_gib", lambda v: v > 0, "must be positive"),
    ("train.max_nonfinite_skips", lambda v: v >= 0, "must be >= 0"),
    ("train.keep_checkpoints", lambda v: v is None or v >= 1, "must be at least 1 (or null: keep all)"),
    ("train.loss_chunk_rows", lambda v: v == "auto" or v >= 0, "must be >= 0 (0: one chunk) or auto"),
    ("train.max_positions", lambda v: v is None or v >= 1, "must be at least 1 (or null: the packing budget)"),
    ("train.mlp_chunk_rows", lambda v: v is None or v == "auto" or v >= 0,
     "must be >= 0 (0: whole; null: the device's default) or auto"),
    ("train.norm_chunk_rows", lambda v: v == "auto" or v >= 0, "must be >= 0 (0: whole) or auto"),
    ("train.offload", lambda v: not isinstance(v, int) or isinstance(v, bool) or v >= 0,
     "must be true, false, auto or a number of layers >= 0"),
]


# Sizes at most (dotted path, largest value, why): a value past them was accepted and failed later, after the run
# directory was written, with a traceback naming nothing ("Overflow when unpacking long long" at the first forward).
MAX_POSITIONS = 2**31 - 1  # a pack's offsets are int32 (cu_seqlens), and nothing this long fits a device
MAX_SECONDS = 365 * 24 * 3600  # a year; a longer timeout overflows timedelta and the collectives' own clocks
MAX_GIB = 2**20  # one PiB
_AT_MOST = [
    *((path, MAX_POSITIONS, "positions are int32 in a pack's offsets") for path in (
        "packing.token_budget", "packing.max_continuations", "packing.continuation_groups", "packing.walk.chunk",
        "packing.walk.horizon", "train.max_positions", "train.loss_chunk_rows", "train.mlp_chunk_rows",
        "generate.max_new_tokens")),
    ("lora.r", 2**16, "an adapter's rank is below its layers' widths"),
    *((path, MAX_SECONDS, "a year") for path in ("ops.hang_timeout", "ops.hang_abort", "ops.collective_timeout")),
    ("ops.host_memory_per_node_gib", MAX_GIB, "one PiB"),
    *((path, 1e9, "a pack's cost must stay a finite number") for path in (
        "train.cost_per_position", "train.cost_per_pair")),
]
_CAPPED = {path for path, _, _ in _AT_MOST}
INT64 = 2**63  # every integer of the config is a C long somewhere (a seed, a size): |value| < 2**63


def _number_problems(obj: Any, prefix: str = "") -> list[str]:
    """Every number of the config that is not a finite float or an integer that fits 64 bits (YAML's ``.nan``,
    ``.inf`` and ``1e999`` are floats), by its dotted path; then the sizes past :data:`_AT_MOST`. A mapping field
    (``model.config``, ``data.template_kwargs``) is the model's or the template's, not checked here."""
    problems = []
    for f in dataclasses.fields(obj):
        if f.metadata.get("internal"):
            continue
        path, value = f"{prefix}.{f.name}" if prefix else f.name, getattr(obj, f.name)
        values = value if isinstance(value, list) else [value]
        if dataclasses.is_dataclass(value):
            problems += _number_problems(value, path)
        elif any(isinstance(v, float) and not math.isfinite(v) for v in values):
            says = _BOUND_MESSAGES.get(path, "")  # its own bound's words, where they say it
            problems.append(f"{path}: {says if says.startswith('must be a finite') else 'must be a finite number'}, "
                            f"got {value!r}")
        elif path not in _CAPPED and any(isinstance(v, int) and not isinstance(v, bool) and abs(v) >= INT64
                                         for v in values):
            problems.append(f"{path}: {value!r} is too large (an integer below 2**63)")
    if prefix:
        return problems
    bad = {p.split(":", 1)[0] for p in problems}
    for path, most, why in _AT_MOST:
        value = get_dotted(obj, path)
        if path not in bad and isinstance(value, (int, float)) and not isinstance(value, bool) and value > most:
            problems.append(f"{path}: must be at most {most:,} ({why}), got {value!r}")
    return problems


_BOUND_MESSAGES = {path: msg for path, _, msg in _BOUNDS}


def built_context_grads(p: PackingConfig) -> tuple[str, ...]:
    """The packing.context_grad values built under the config's packing.mode (the support table's: tree, full
    only)."""
    return support.built_context_grads(p.mode)


def _validate(cfg: Config) -> list[str]:
    problems = _number_problems(cfg)
    numbers = {p.split(":", 1)[0] for p in problems}  # a NaN fails every bound: said once
    for path, ok, msg in _BOUNDS:
        value = get_dotted(cfg, path)
        if value is not None and path not in numbers and not ok(value):
            problems.append(f"{path}: {msg}, got {value!r}")
    # what packtrain builds: one table (packtrain/config/support.py); the data's images are ruled on once read
    problems += support.refusals(support.Combination.of(cfg))
    if cfg.train.objective != "dpo" and cfg.train.rpo_alpha:
        problems.append(f"train.rpo_alpha: weighs the chosen answers' cross-entropy under train.objective dpo, not "
                        f"{cfg.train.objective} (set 0)")
    if cfg.rl.num_generations is not None and cfg.train.objective != "grpo":
        problems.append(f"rl.num_generations: samples completions for train.objective grpo, not "
                        f"{cfg.train.objective} (leave it null)")
    if cfg.train.packs_per_step is not None and cfg.train.packs_per_rank != 1:
        problems.append(f"train.packs_per_rank, train.packs_per_step: give one (packs per rank, or the step's packs "
                        f"over all ranks), got {cfg.train.packs_per_rank} and {cfg.train.packs_per_step}")
    if cfg.model.path is not None and cfg.model.config is not None:
        problems.append("model: give either model.path or model.config, not both")
    if cfg.model.adapter is not None and cfg.model.path is None and cfg.model.config is None:
        problems.append("model.adapter: is folded into the base of model.path or model.config, and neither is set")
    if cfg.lora.target_parameters and cfg.lora.dropout > 0:
        problems.append(f"lora.dropout: must be 0 with lora.target_parameters (peft cannot drop out the input of a "
                        f"targeted parameter), got {cfg.lora.dropout!r}")
    if cfg.generate.every is not None and not cfg.data.eval:
        problems.append("generate.every: generates on data.eval, which is not set")
    if cfg.train.cost_per_position == 0 and cfg.train.cost_per_pair == 0:
        problems.append("train.cost_per_position, train.cost_per_pair: both 0 gives every pack cost 0 (and the "
                        "utilisation 0/0); set one above 0, or leave one null for the model's figure")
    problems += template_kwargs_problems(cfg.data.template_kwargs or {})
    offload = cfg.train.offload
    if cfg.train.activation_checkpointing is False and offload not in (False, 0, "auto"):
        problems.append(f"train.offload: keeps checkpointed layers' inputs in host memory, and "
                        f"train.activation_checkpointing is false (it would be turned on silently), got {offload!r}: "
                        "set activation_checkpointing true or auto, or offload false")
    if cfg.model.kernels == "fla" and cfg.model.dtype == "float64":  # fla's kernels are float32/bf16 only
        problems.append("model.kernels: fla runs in float32 or bfloat16, not model.dtype float64 (use torch)")
    return problems


def config_from_dict(raw: dict, base_dir: str = ".", source: str | None = None) -> Config:
    problems: list[str] = []
    cfg = build(Config, raw, "", problems)
    # A field with a wrong type keeps its (valid) default, so the bounds checks can still run: every problem is
    # reported in one go.
    problems += _validate(cfg)
    if problems:
        raise ConfigError(problems, source)
    cfg.base_dir = base_dir
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"config file not found: {path}"])
    try:
        raw = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {yaml_problem(e)}"], str(path)) from None
    if not isinstance(raw, dict):
        raise ConfigError(["the top level must be a mapping"], str(path))
    raw = apply_overrides(raw, overrides or [])
    return config_from_dict(raw, base_dir=str(path.parent.resolve()), source=str(path))
