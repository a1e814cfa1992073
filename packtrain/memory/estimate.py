"""Per-GPU memory estimate for one pack: every term shown, so a user sees what to change before a job fails.

Pure arithmetic from the model's text config (a dict) and the pack's size; no torch. Units: T positions in the
pack, M target tokens, H hidden, I intermediate, V vocabulary, b bytes of the model dtype, a bytes of the LoRA
weights (peft's autocast keeps adapters of a bf16 model in float32: packtrain's ``apply_lora`` does).

Exact terms (Qwen3.6-27B's figures at a 70K-token pack, tested in tests/memory/test_estimate.py): a checkpointed layer
input is [T, H] in b bytes (70K x 5120 bf16 = 0.67 GiB; 64 layers = 43 GiB); an MLP intermediate is [T, I] (70K x
17408 = 2.3 GiB) and SwiGLU saves three of them (gate, SiLU(gate), up), one tile's rows of them when the MLP runs in
tiles; a LoRA adapter computing in the model's dtype saves the input its base layer reads (once per input, shared by
q, k and v) and its [T, r] product, no copy and no dropout mask (packtrain/models/lora_compute.py); logits at every
position are [T, V] (144K x 248,320 bf16 = 71.5 GB), target-only ones [M, V], one chunk's rows when the loss runs in
chunks. The MLP and adapter terms are checked against autograd's saved
tensors on CPU.

``packing.context_grad`` (packtrain/packed/context.py): ``kv_only`` keeps full's forward and checkpoints (its saving is
backward time), so its estimate is full's; ``frozen`` keeps nothing of P for backward: the checkpointed inputs and
the recomputed layer span the continuations only, plus P's cache (attention K/V of P in every full-attention layer,
each GDN layer's float32 state and conv tail), and P's no_grad pass peaks before the continuations run.

Approximate terms (marked ~): what the attention / Gated DeltaNet kernels (fla's) and the RMSNorms save, the backward
workspace, an adapter's output while its linear runs, and FSDP's gathered weights. They depend on kernels:
``plan --memory --measure`` counts the step itself (:mod:`packtrain.memory.measure`; tests/memory/test_measure.py holds the
estimate within 10% of it), ``packtrain smoke`` measures it on the device.

The peak is the largest phase (:attr:`MemoryEstimate.phases`): the forward, the loss, one layer's recompute (the
larger of its backward and its widest adapter's forward), the optimizer step; a phase's transients are never added to
another's. Which of the step's savings the terms count (:class:`StepSavings`: the chunked loss, the tiled MLP, LoRA
in the model's dtype, regenerated dropout masks, recomputed norms) follows the config.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from packtrain.config.tiles import TILE_ROWS, offload_layers
from packtrain.models.parameters import (
    expert_shapes,
    layer_parameters,
    linears,
    lora_parameters,
    model_parameters,
    saved_module_parameters,
    targeted,
)
from packtrain.models.text_config import DENSE, FULL, MOE, config_dict_of, kind_name, split_kind, text_config
from packtrain.packed.context import context_grad as context_mode
from packtrain.packed.families import FAMILIES

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
OFFLOAD_CHUNK_BYTES = 64 * 2**20  # packtrain.models.offload.DEFAULT_CHUNK_BYTES (tested equal)
GDN_CALL_ROWS = 65_536  # packtrain.packed.kernels.fla_backend.CALL_ROWS: continuation rows per delta-rule call

@dataclass
class Term:
    key: str
    label: str
    bytes: int
    where: str = "device"  # device | host | compare (shown, not added)
    approx: bool = False
    depth: int = 0  # 1: part of the term above


@dataclass
class MemoryEstimate:
    terms: list[Term]
    title: str
    phases: dict[str, int] = dataclasses.field(default_factory=dict)  # phase -> device bytes alive at its peak
    savings: object = None  # the StepSavings it counted

    def get(self, key: str) -> Term:
        return next(t for t in self.terms if t.key == key)

    def total(self, where: str = "device") -> int:
        """Device: the largest phase (never two phases' transients together); host: every host term."""
        if where == "device" and self.phases:
            return max(self.phases.values())
        return sum(t.bytes for t in self.terms if t.where == where and t.depth == 0)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)


def _shape(*dims: int) -> str:
    return "[" + ", ".join(f"{d:,}" for d in dims) + "]"


def adapter_terms(text: dict, layer_type, T: int, b: int, a: int, r: int, targets: list[str],
                  dropout: float, mask_bytes: int = 1, masks_regenerated: bool = False,
                  mlp_rows: int | None = None) -> list[Term]:
    """What each adapter of one layer saves for backward: its input (a copy when peft casts it to the adapter dtype
    or drops it out, plus the dropout mask, unless the mask is regenerated in backward), and lora_A's [T, r] output.
    ``mask_bytes``: 1 on CUDA (the fused dropout keeps a bool mask); CPU's unfused dropout keeps it in the input's
    dtype (``a``). ``mlp_rows``: a tiled MLP's adapters hold one tile's rows at a time, and gate/up_proj's input is
    a view of the MLP's input, which the tiles keep (:func:`mlp_terms` counts it). Without an attention output gate
    o_proj reads the attention kernel's output, which :func:`mixer_term` counts."""
    terms, shared = [], set()
    if mlp_rows:
        shared.add("post_norm")
    if not FAMILIES[text["family"]].attention_gate:
        shared.add("attention_out")
    own_copy = a != b or (dropout > 0 and not masks_regenerated)
    mask = mask_bytes if dropout > 0 and not masks_regenerated else 0
    for name, (din, _, group) in linears(text, layer_type).items():
        if name not in targets:
            continue
        rows = min(mlp_rows, T) if mlp_rows and group in ("post_norm", "mlp_product") else T
        if own_copy:
            n = rows * din * (a + mask)
            kind = "float32" if a == 4 else f"{a}-byte"
            what = f"{_shape(rows, din)} {kind} copy" + (" + dropout mask" if mask else "")
        else:
            n = 0 if group in shared else rows * din * b
            shared.add(group)
            what = f"{_shape(rows, din)} input" + (" (shared: counted once)" if n == 0 else "")
        terms.append(Term(f"lora:{name}", f"{name} adapter input {what}", n + rows * r * a, depth=1))
    return terms


def lora_output_term(text: dict, layer_type, T: int, a: int, targets: list[str],
                     mlp_rows: int | None = None, copies: int = 2) -> list[Term]:
    """The widest adapter's output while its linear runs, alive for a moment, not saved: peft's lora_B output and
    its scaled copy (``copies`` 2, in the adapter's dtype); packtrain's LoRA in the model's dtype adds one delta into
    the base output in place (1)."""
    widths = [(min(mlp_rows, T) if mlp_rows and group in ("post_norm", "mlp_product") else T, out, name)
              for name, (_, out, group) in linears(text, layer_type).items() if name in targets]
    if not widths:
        return []
    rows, out, name = max(widths, key=lambda w: w[0] * w[1])
    what = "output + its scaling: 2" if copies == 2 else "delta: 1"
    return [Term("lora_out", f"{name} adapter {what} x {_shape(rows, out)} ({a}-byte)",
                 copies * rows * out * a, approx=True, depth=1)]


def mixer_term(text: dict, layer_type, T: int, b: int, norms_recomputed: bool = False,
               continuations: float = 0.5) -> Term:
    """What the mixer saves. ``continuations``: the continuations' share of the T positions (the GDN conv gathers a
    copy of their rows; attention copies the continuations' and P's rows per bucket). With recomputed norms the
    GDN's gated norm inputs are a term of their own (:func:`norm_terms`: its backward frees them)."""
    mixer, _ = split_kind(layer_type)
    if mixer == FULL:
        q, kv = text["num_attention_heads"] * text["head_dim"], text["num_key_value_heads"] * text["head_dim"]
        gate = FAMILIES[text["family"]].attention_gate
        if norms_recomputed:
            # q_proj's output (the q norm's saved input is a view of it, the gate half too) and k_proj's (the k
            # norm's), v; rotated q and k; the kernel's output, and the gate's sigmoid; per bucket, copies of the
            # continuations' q, k and output, and of P's k and output
            q_out = 2 * q if gate else q
            per = b * (q_out + 2 * kv + (q + kv) + q + (q if gate else 0))
            per += b * (continuations * (2 * q + kv) + (1 - continuations) * (q + kv))
            return Term("mixer", "attention: q/k/v projections (the q/k norms' inputs), rotary q/k, FlexAttention's "
                        "padded q/k/v and output" + (", gate's sigmoid" if gate else ""), round(T * per),
                        approx=True, depth=1)
        # q/k RMSNorm float32 copies; rotated q, k; attention's q, k, v, output; the output gate and its sigmoid
        per = (0 if norms_recomputed else 4 * (q + kv)) + b * ((5 if gate else 3) * q + 3 * kv)
        label = "attention: q/k norms, rotary, kernel in/out" + (", output gate" if gate else "")
    else:
        key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
        value = text["linear_num_value_heads"] * text["linear_value_head_dim"]
        conv_dim = 2 * key + value
        HV = text["linear_num_value_heads"]
        # what fla's kernels save: the conv's input (the projection's output, and a gathered copy of the
        # continuations' rows), contiguous v (fla's input_guard copies it off the conv's output), l2-normed q and k
        # with their float32 rstd, the WY blocks (64 per value head), g (float32) and beta; without recomputed norms
        # z and the gated norm's float32 copies
        per = b * ((1 + continuations) * conv_dim + value + 2 * key + 64 * HV + HV)
        per += 4 * (HV + 2 * text["linear_num_key_heads"])
        if norms_recomputed:
            return Term("mixer", "Gated DeltaNet (fla's saved tensors): conv in, contiguous v, q/k l2-normed, WY "
                        "blocks, g, beta", round(T * per), approx=True, depth=1)
        per += b * value + 4 * 3 * value
        label = "Gated DeltaNet (fla's saved tensors): conv in, contiguous v, q/k l2-normed, WY blocks, z, gated norm"
    return Term("mixer", label, round(T * per), approx=True, depth=1)


def gdn_kernel_terms(text: dict, T: int, b: int, continuations: float) -> tuple[Term, int]:
    """fla's chunk rule in a GDN layer (its largest call, P's or one of the continuations' calls of at most
    :data:`GDN_CALL_ROWS` rows, has ``rows``): in
    backward, its recomputed w, u and chunk states h, their gradients and the float32 dq, dk, beside every call's
    output gradient and the gated norm's input and gate gradients (a term of the layer's backward); and the bytes
    alive at the top of its forward beside the layer's input: the input norm's output, the projections and the
    conv's output, the call's w, u, v_new, output, chunk states, contiguous v, l2-normed q/k and WY blocks, the other
    call's output (the forward phase's)."""
    key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    HV, K, V = text["linear_num_value_heads"], text["linear_key_head_dim"], text["linear_value_head_dim"]
    value, conv_dim, H = HV * V, 2 * key + HV * V, text["hidden_size"]
    rows = max(round(T * (1 - continuations)), min(round(T * continuations), GDN_CALL_ROWS))
    states = HV * K * V // 64  # the chunk states [T / 64, HV, K, V] per row
    wk = HV * K  # w, dw, and dq / dk per value head
    backward = rows * (b * (4 * wk + 3 * value + 2 * states) + 4 * HV) + T * b * 3 * value
    forward = (T * b * (H + 2 * conv_dim + value) + rows * b * (5 * value + states + 2 * key + 64 * HV)
               + (T - rows) * b * value)
    term = Term("gdn_backward", f"fla's chunk rule in backward (its largest call, {rows:,} rows): recomputed w, u, "
                f"chunk states, their gradients and dq/dk per value head; the output and the gated norm's gradients",
                backward, approx=True, depth=1)
    return term, forward


def mlp_terms(text: dict, layer_type, T: int, b: int, target_parameters=(), mlp_rows: int | None = None
              ) -> list[Term]:
    """The MLP's saved intermediates and its backward workspace (SwiGLU's: the gradient of the product and mul's two
    gradients). A tiled dense MLP (``mlp_rows``) keeps its input for the tiles' recompute and one tile's
    intermediates at a time; while a tile's backward runs, the MLP input's gradient (filled tile by tile) and the
    tile's output exist too (packtrain/packed/recompute.py). Routed experts (approximate: the per-expert
    loop's gathers and outputs) see T x k token rows of width I_e; targeted expert stacks are saved adapted (W + BA:
    peft's parametrization makes a new [experts, out, in] tensor per stack)."""
    H = text["hidden_size"]
    if split_kind(layer_type)[1] == DENSE:
        I = text["intermediate_size"]
        if mlp_rows:
            R = min(mlp_rows, T)
            return [Term("mlp", f"tiled MLP: its input {_shape(T, H)} (kept for the tiles' recompute)", T * H * b,
                         depth=1),
                    Term("mlp_tile", f"one tile's 3 x {_shape(R, I)} (gate, SiLU(gate), up; in its recompute)",
                         3 * R * I * b, depth=1),
                    Term("mlp_first", f"gate_proj's output {_shape(R, I)} (one tile)", R * I * b, depth=1),
                    Term("workspace", f"backward workspace: 3 x {_shape(R, I)} SwiGLU gradients (one tile), the tile's "
                         f"output {_shape(R, H)}, the input's gradient {_shape(T, H)}",
                         (3 * R * I + R * H + T * H) * b, approx=True, depth=1)]
        return [Term("mlp", f"MLP intermediates: 3 x {_shape(T, I)} (gate, SiLU(gate), up)", 3 * T * I * b, depth=1),
                Term("mlp_first", f"gate_proj's output {_shape(T, I)} (in the recompute)", T * I * b, depth=1),
                Term("workspace", f"backward workspace: 3 x {_shape(T, I)} SwiGLU gradients",
                     3 * T * I * b, approx=True, depth=1)]
    k, E, Ie, Is = (text["num_experts_per_tok"], text["num_experts"], text["moe_intermediate_size"],
                    text["shared_expert_intermediate_size"])
    rows = T * k
    terms = [Term("mlp", f"MoE: shared expert 3 x {_shape(T, Is)}, router float32 {_shape(T, E)} x 2, experts' "
                         f"{_shape(rows, H)} inputs + outputs and 4 x {_shape(rows, Ie)}",
                  3 * T * Is * b + 8 * T * E + rows * (2 * H + 4 * Ie) * b, approx=True, depth=1)]
    adapted = [(n, e * i * o) for n, (e, i, o) in expert_shapes(text, layer_type).items()
               if targeted(n, target_parameters)]
    if adapted:
        terms.append(Term("experts_adapted", f"adapted expert stacks (W + BA): {', '.join(n for n, _ in adapted)}",
                          sum(n for _, n in adapted) * b, depth=1))
    terms.append(Term("workspace", f"backward workspace: 2 x {_shape(rows, Ie)} expert gradients",
                      2 * rows * Ie * b, approx=True, depth=1))
    return terms


def layer_recompute(text: dict, layer_type, T: int, b: int, a: int, r: int, targets: list[str],
                    dropout: float, mask_bytes: int = 1, target_parameters=(), savings=None,
                    continuations: float = 0.5) -> list[Term]:
    """One decoder layer's saved tensors while its backward runs, plus the largest transient (the backward
    workspace, or the widest adapter's output): see :func:`layer_total`."""
    savings = savings or StepSavings()
    H = text["hidden_size"]
    rows = savings.mlp_rows if split_kind(layer_type)[1] == DENSE else 0
    mlp, workspace = (lambda ts: (ts[:-1], ts[-1]))(mlp_terms(text, layer_type, T, b, target_parameters, rows))
    norms = (norm_terms(text, layer_type, T, b, savings.norm_rows) if savings.norms_recomputed else
             [Term("norms", f"RMSNorm float32 copies: 2 x {_shape(T, H)}", 2 * T * H * 4, approx=True, depth=1)])
    gdn = [gdn_kernel_terms(text, T, b, continuations)[0]] if split_kind(layer_type)[0] != FULL else []
    return [
        *mlp,
        *adapter_terms(text, layer_type, T, b, a, r, targets, dropout, mask_bytes, savings.masks_regenerated, rows),
        mixer_term(text, layer_type, T, b, savings.norms_recomputed, continuations),
        *norms,
        workspace,
        *gdn,
        *lora_output_term(text, layer_type, T, a, targets, rows, 1 if savings.lora_in_model_dtype else 2),
    ]


def forward_transient(text: dict, layer_type, T: int, b: int, terms: list[Term], continuations: float) -> int:
    """The top of a checkpointed layer's forward beside its input (which keeps nothing for backward): the mixer's
    (the GDN's chunk rule forward, :func:`gdn_kernel_terms`; attention: what it saves, with the input norm's output)
    or the MLP's (the post-attention norm's output, its intermediates over one tile or the whole buffer, an
    adapter's output)."""
    H = text["hidden_size"]
    if split_kind(layer_type)[0] != FULL:
        mixer = gdn_kernel_terms(text, T, b, continuations)[1]
    else:
        mixer = T * H * b + _sum(terms, {"mixer"})
    mlp = T * H * b + _sum(terms, {"mlp_tile", "mlp_first", "lora_out"} if any(t.key == "mlp_tile" for t in terms)
                           else {"mlp", "lora_out"})
    return max(mixer, mlp)


def norm_terms(text: dict, layer_type, T: int, b: int, rows: int) -> list[Term]:
    """Norms in recomputed row tiles (packtrain/packed/recompute.py, ``train.norm_chunk_rows`` > 0) save only their
    inputs in the model's dtype; a norm's backward recomputes one tile at a time in float32 (:func:`norm_backward_term`)
    beside its saved input and its input's gradient (tests/memory/test_measure.py counts it).
    The layer's input norm reads the layer's input (kept anyway); the post-attention norm saves [T, H]; a GDN's
    gated norm saves its input and gate ([T, value] each). The q/k norms' inputs are the projections' outputs
    (:func:`mixer_term`)."""
    H = text["hidden_size"]
    terms = [Term("norm_input", f"the post-attention norm's input {_shape(T, H)}", T * H * b, depth=1),
             norm_backward_term(text, "norm_backward", "the post-attention norm's backward", T, H, b, rows, depth=1)]
    if split_kind(layer_type)[0] != FULL:
        value = text["linear_num_value_heads"] * text["linear_value_head_dim"]
        terms += [Term("gated_norm_input", f"the gated norm's input and gate: 2 x {_shape(T, value)}",
                       2 * T * value * b, depth=1),
                  norm_backward_term(text, "gated_norm_backward", "the gated norm's backward", T, value, b, rows,
                                     beside=3, depth=1)]
    return terms


def norm_backward_term(text: dict, key: str, label: str, T: int, D: int, b: int, rows: int, beside: int = 2,
                       depth: int = 0) -> Term:
    """A norm's backward over [T, D] inputs: whole (``rows`` 0), six float32 pieces of the input's shape (the input
    cast, the squares' gradient and the mean's, two products' gradients); in tiles, six float32 pieces of one tile
    (as many elements as ``rows`` rows of the hidden state) and the tile's recomputed output, beside ``beside``
    [T, D] tensors in the model's dtype
    (the incoming gradient and the input's, filled tile by tile; a gated norm's gate's, the final norm's saved
    input)."""
    if not rows:
        return Term(key, f"{label}: 6 x {_shape(T, D)} float32", 6 * T * D * 4, approx=True, depth=depth)
    tile = min(rows * text["hidden_size"], T * D)
    return Term(key, f"{label} in tiles of {rows:,} rows: 6 x {tile:,} float32 and the tile's output + {beside} x "
                     f"{_shape(T, D)} gradients", tile * (6 * 4 + b) + beside * T * D * b, approx=True, depth=depth)


def layer_total(terms: list[Term]) -> int:
    """What is alive at a layer's peak, the largest of its moments: the MLP's backward (everything the layer saves,
    plus the MLP's backward workspace); each recomputed norm's backward (what the layer saves before that norm, the
    MLP's terms gone, plus the norm's float32 recompute); and the widest adapter's forward in the recompute (what
    the layer saved before its MLP, the MLP's first output, and that adapter's output)."""
    def alive(but) -> int:
        return sum(t.bytes for t in terms if t.key not in _TRANSIENT | but)

    moments = [alive(set()) + _sum(terms, {"mlp_tile", "workspace"}),
               alive(_AFTER_GATE) + _sum(terms, {"mlp_first", "lora_out"})]
    if any(t.key == "norm_backward" for t in terms):  # a tiled norm's saved input is alive until it is done
        mlp = _AFTER_GATE | {"lora:gate_proj"}
        moments.append(alive(mlp) + _sum(terms, {"norm_backward"}))
        if any(t.key == "gated_norm_backward" for t in terms):  # out_proj's backward has run: its input is gone
            moments.append(alive(mlp | {"norm_input", "lora:out_proj"}) + _sum(terms, {"gated_norm_backward"}))
    if any(t.key == "gdn_backward" for t in terms):  # the chunk rule's backward: the layer's later parts are done
        done = _AFTER_GATE | {"lora:gate_proj", "norm_input", "lora:out_proj", "gated_norm_input", "norms"}
        moments.append(alive(done) + _sum(terms, {"gdn_backward"}))
    return max(moments)


def _sum(terms: list[Term], keys) -> int:
    return sum(t.bytes for t in terms if t.key in keys)


_AFTER_GATE = {"mlp", "mlp_first", "experts_adapted", "lora:up_proj", "lora:down_proj"}


@dataclass(frozen=True)
class StepSavings:
    """What the training step keeps, as the estimate counts it (the choice of :mod:`packtrain.memory.savings`):
    checkpointed decoder layers (``activation_checkpointing``), the first ``offload_layers`` layers' checkpointed
    inputs in host memory (implies checkpointing), the chunked loss (``loss_rows`` target rows per chunk of lm_head +
    cross-entropy, recomputed in backward; 0: all rows at once), the tiled dense MLP (``mlp_rows`` buffer rows per
    recomputed tile; 0: whole), the norms in recomputed row tiles (``norm_rows``; 0: whole, their float32 copies
    kept), LoRA computing in the model's dtype (no float32 copies), dropout masks regenerated in backward (no copy
    per adapter)."""
    activation_checkpointing: bool = False
    offload_layers: int = 0
    loss_rows: int = 0
    mlp_rows: int = 0
    norm_rows: int = 0
    lora_in_model_dtype: bool = False
    masks_regenerated: bool = False

    @property
    def checkpointing(self) -> bool:
        return self.activation_checkpointing or self.offload_layers > 0

    @property
    def norms_recomputed(self) -> bool:
        return self.norm_rows > 0

    def describe(self) -> list[str]:
        def rows(n):
            return f"{n:,} rows" if n else "off"

        layers = "off" if not self.checkpointing else (f"on, {self.offload_layers} layer inputs in host memory"
                                                       if self.offload_layers else "on")
        return [f"checkpointing: {layers}", f"chunked loss: {rows(self.loss_rows)}", f"tiled MLP: {rows(self.mlp_rows)}",
                f"norms in tiles: {rows(self.norm_rows)}",
                f"LoRA in the model's dtype: {'on' if self.lora_in_model_dtype else 'off (float32 copies)'}",
                f"dropout masks regenerated: {'on' if self.masks_regenerated else 'off (kept)'}"]


def savings_for(cfg, device: str = "cuda") -> StepSavings:
    """The savings of a config whose ``train`` values are chosen (:meth:`packtrain.memory.savings.Choice.apply`, or
    given): ``train.mlp_chunk_rows`` null is the device's default tile."""
    t = cfg.train
    given = (t.activation_checkpointing, t.offload, t.loss_chunk_rows, t.mlp_chunk_rows, t.norm_chunk_rows)
    if "auto" in [v for v in given if isinstance(v, str)]:
        raise ValueError("memory.savings_for: the train.* savings are still auto (choose them first: "
                         "packtrain.memory.savings.choose)")
    mlp = t.mlp_chunk_rows if t.mlp_chunk_rows is not None else TILE_ROWS[device]["mlp"]
    offload = offload_layers(t.offload, layer_count(cfg))
    return StepSavings(activation_checkpointing=bool(t.activation_checkpointing), offload_layers=offload,
                       loss_rows=t.loss_chunk_rows, mlp_rows=mlp, norm_rows=t.norm_chunk_rows,
                       lora_in_model_dtype=True, masks_regenerated=True)


def layer_count(cfg) -> int:
    """The decoder layers of a config's model."""
    return text_config(config_dict_of(cfg))["num_hidden_layers"]


def estimate(text: dict, positions: int, targets: int, *, dtype: str = "bfloat16", adapter_dtype: str | None = None,
             lora_r: int = 8, lora_targets: list[str] = (), lora_dropout: float = 0.0, optimizer: str = "adamw",
             momentum: float = 0.0, world_size: int = 1,
             continuations: int | None = None, offload_chunk_bytes: int = OFFLOAD_CHUNK_BYTES,
             lora_parameters_targets: list[str] = (), modules_to_save: list[str] = (), context_grad: str = "full",
             prefix: int = 0, group_positions: int | None = None,
             savings: StepSavings = StepSavings()) -> MemoryEstimate:
    """The peak is the largest phase (:attr:`MemoryEstimate.phases`): the forward, the loss (head, cross-entropy and
    their backward), one layer's recompute and backward (layers recompute one at a time), the optimizer step; each
    with every term alive then (weights, gathered units, adapters with their gradients and optimizer states, the
    checkpointed inputs), never two phases' transients together.

    ``group_positions``: with ``packing.continuation_groups`` > 1, the continuation positions of the pack's
    largest group (packtrain/packed/groups.py): the graph alive is P's and that group's, a layer's recompute the larger of
    P's and the group's, plus the gradients of P's K/V, states and tails the groups sum."""
    M, W = targets, world_size
    context = context_mode(context_grad)
    T, T_layer = context.graph_rows(positions, prefix, group_positions)  # frozen: the continuations' rows alone
    H, V, L = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    b = DTYPE_BYTES[dtype]
    a = DTYPE_BYTES[adapter_dtype] if adapter_dtype else (b if savings.lora_in_model_dtype else 4 if b == 2 else b)
    targets_list = list(lora_targets)
    checkpointing, offloaded = savings.checkpointing, savings.offload_layers
    sharded = f", / {W} ranks" if W > 1 else ""
    terms: list[Term] = []
    static: list[str] = []  # keys of the terms alive in every phase

    n_params = model_parameters(text)
    terms.append(Term("weights", f"base weights: {n_params / 1e9:.2f}B parameters, {dtype}{sharded}",
                      math.ceil(n_params * b / W)))
    static.append("weights")
    biggest = max(layer_parameters(text, k) for k in set(text["kinds"])) * b
    gathered = {"layer": 2 * biggest, "loss": biggest + (V * H + H) * b, "optimizer": 0} if W > 1 else {}
    if W > 1:
        # Decoder layers, the embedding and the head are FSDP units of their own (packtrain.models.wrap.fsdp_units):
        # two layers at a time (one running, one prefetched); the loss holds the head and one layer.
        terms.append(Term("gathered", "FSDP gathered: 2 decoder layers (the loss: the head and 1 layer)",
                          max(gathered.values()), approx=True))
    n_lora = lora_parameters(text, lora_r, targets_list, lora_parameters_targets)
    states = {"adamw": 2, "sgd": 1 if momentum else 0}[optimizer]
    master = 4 if b == 2 else b  # master adapter weights, their gradients and states stay float32
    terms.append(Term("adapters", f"LoRA: {n_lora / 1e6:.1f}M parameters x (weight, grad, {states} optimizer states)"
                      f" x {master} bytes{sharded}", math.ceil(n_lora * master * (2 + states) / W)))
    static.append("adapters")
    n_saved = saved_module_parameters(text, modules_to_save)
    if n_saved:
        # lora.modules_to_save: peft trains a full copy beside the frozen original (counted in the base weights),
        # in the model's dtype, with its gradient and optimizer states
        terms.append(Term("saved_modules", f"modules_to_save ({', '.join(modules_to_save)}): {n_saved / 1e6:.2f}M "
                          f"parameters x (copy, grad, {states} optimizer states) x {b} bytes{sharded}",
                          math.ceil(n_saved * b * (2 + states) / W)))
        static.append("saved_modules")
    if not context.prefix_in_graph:  # frozen: P's state kept as constants
        terms += frozen_prefix_terms(text, prefix, b)
        static.append("prefix_cache")
    elif group_positions is not None:
        cache = frozen_prefix_terms(text, prefix, b)[0]
        terms.append(Term("prefix_grads", "gradients of P's outputs the groups sum: " + cache.label.split(": ", 1)[1],
                          cache.bytes))
        static.append("prefix_grads")

    layer_input = T * H * b
    kinds = sorted(set(text["kinds"]))
    share = (T_layer - prefix) / T_layer if prefix and context.prefix_in_graph else 1.0
    per_kind = {k: layer_recompute(text, k, T_layer, b, a, lora_r, targets_list, lora_dropout,
                                   target_parameters=lora_parameters_targets, savings=savings, continuations=share)
                for k in kinds}
    kind = max(kinds, key=lambda k: layer_total(per_kind[k]))
    carried: list[str] = []  # alive from the end of the forward to the end of backward
    if offloaded:
        chunks = math.ceil(layer_input / offload_chunk_bytes) * offload_chunk_bytes
        terms.append(Term("offloaded_inputs", f"offloaded layer inputs: the first {offloaded} of {L} x "
                          f"{_shape(T, H)} {dtype} ({offload_chunk_bytes // 2**20} MiB chunks)", offloaded * chunks,
                          where="host"))
    if checkpointing:
        if L > offloaded:
            terms.append(Term("checkpointed_inputs", f"checkpointed layer inputs on the device: {L - offloaded} x "
                              f"{_shape(T, H)} {dtype}", (L - offloaded) * layer_input))
            carried.append("checkpointed_inputs")
        terms.append(Term("residual", f"gradient of the hidden states: {_shape(T, H)}", layer_input))
        if offloaded:
            # in an offloaded layer's backward: its input fetched back, and the layer before's being prefetched
            terms.append(Term("fetched", f"an offloaded layer's input fetched back + the next one's prefetch: 2 x "
                              f"{_shape(T, H)}", 2 * layer_input))
    else:
        graph = per_kind if T == T_layer else {
            k: layer_recompute(text, k, T, b, a, lora_r, targets_list, lora_dropout,
                               target_parameters=lora_parameters_targets, savings=savings, continuations=share)
            for k in kinds}
        # each layer's saved tensors; a tiled input norm keeps the layer's input too (a checkpointed layer's input
        # is counted as such)
        kept_input = layer_input if savings.norms_recomputed else 0
        saved_by_layer = [sum(t.bytes for t in graph[k] if t.key not in _TRANSIENT) + kept_input
                          for k in text["kinds"]]
        terms.append(Term("all_layers", f"saved activations of all {L} layers (no checkpointing)",
                          sum(saved_by_layer), approx=True))
        terms.append(Term("residual", f"gradient of the hidden states: {_shape(T, H)}", layer_input))
        carried.append("all_layers")
    title = "one layer's recompute" if checkpointing else "one layer's backward"
    layer_totals = {k: layer_total(per_kind[k]) for k in kinds}
    what = kind[0].replace("_", " ") + (", MoE" if kind[1] == MOE else "")
    terms.append(Term("layer_peak", f"{title} ({what} layer, the largest)", layer_totals[kind], approx=True))
    terms.extend(per_kind[kind])

    rows = min(savings.loss_rows, M) if savings.loss_rows else M
    chunk = f" in chunks of {rows:,} rows, recomputed in backward" if savings.loss_rows else ""
    # three float32 [rows, V] alive in the log-softmax's backward (per chunk when chunked), the head's own output
    # freed by then
    terms.append(Term("logits", f"target-only logits {_shape(rows, V)}{chunk}: 3 float32 in the log-softmax's "
                      "backward", rows * V * 3 * 4))
    terms.append(Term("loss_hidden", f"the target rows' hidden states and their gradient: 2 x {_shape(M, H)}",
                      2 * M * H * b))
    # after the chunks, the final RMSNorm's backward runs in float32: its intermediate gradients over the whole
    # buffer, or one tile's of them beside its saved input and its input's gradient
    terms.append(norm_backward_term(text, "final_norm", "the final norm's backward", T, H, b, savings.norm_rows,
                                    beside=3))
    if offloaded:  # the embedding's output stays alive (the first layer's input); checkpointed inputs hold it else
        terms.append(Term("embedding_out", f"the embedding's output {_shape(T, H)}", layer_input))
    terms.append(Term("logits_full", f"not needed: logits at every position {_shape(positions, V)} {dtype}",
                      positions * V * b, where="compare"))

    def alive(keys) -> int:
        return sum(t.bytes for t in terms if t.key in keys and t.where == "device")

    base = alive(static)
    # the forward: a checkpointed layer keeps nothing, so its peak is a layer's transients (an adapter's output
    # beside the MLP's first intermediate); without checkpointing, every layer's saved tensors
    if checkpointing:  # a checkpointed layer keeps nothing: its forward's top is transient
        transient = max(forward_transient(text, k, T_layer, b, per_kind[k], share) for k in kinds)
    else:  # every layer's saved tensors are in all_layers: the kernels' workspace and an adapter's output beside them
        transient = max(sum(t.bytes for t in per_kind[k] if t.key in ("lora_out", "mlp_first")) for k in kinds)
    # an offloaded layer's input is on the device while its forward runs (and is being copied out)
    running = layer_input if checkpointing and offloaded else 0
    phases = {"forward": base + gathered.get("layer", 0) + alive(carried) + running + transient,
              "loss": base + gathered.get("loss", 0) + alive(carried) + alive(["embedding_out", "loss_hidden"])
              + max(alive(["logits"]), alive(["final_norm"]))}
    for k in kinds:
        name = f"{'recompute' if checkpointing else 'backward'} {kind_name(text, k)}"
        at = [j for j, kj in enumerate(text["kinds"]) if kj == k]
        if checkpointing:
            # backward runs last layer first: at layer j the device still holds the checkpointed inputs of the
            # resident layers up to j (its own among them), an offloaded j its input fetched back, and while j runs
            # the prefetch of layer j - 1's input when that one is offloaded
            def graph_alive(j):
                return (max(0, j - offloaded + 1) + (j < offloaded) + (1 <= j <= offloaded)) * layer_input
        else:
            # at the last layer of kind k the layers after it have freed their saved tensors, and its own are in
            # layer_totals[k]
            at = at[-1:]

            def graph_alive(j):
                return sum(saved_by_layer[:j])
        phases[name] = (base + gathered.get("layer", 0) + max(graph_alive(j) for j in at)
                        + alive(["residual", "embedding_out"]) + layer_totals[k])
    # AdamW's step: its foreach kernels hold about two more copies of the trained tensors
    phases["optimizer"] = base + math.ceil((n_lora * master + n_saved * b) * 2 / W)
    conts = f", {continuations} continuations" if continuations is not None else ""
    mode = context.estimate_note()
    if group_positions is not None:
        mode += f"; continuations in groups (the largest {group_positions:,} positions)"
    return MemoryEstimate(terms, f"memory per GPU for the largest pack: {positions:,} positions{conts}, {M:,} target "
                                 f"tokens; world size {W}{mode}", phases, savings)


_TRANSIENT = {"workspace", "lora_out", "mlp_first", "mlp_tile", "norm_backward", "gated_norm_backward",
              "gdn_backward"}  # alive only for a moment of the layer's recompute or backward


def frozen_prefix_terms(text: dict, prefix: int, b: int) -> list[Term]:
    """P's cache, kept until the continuations' backward is done, and P's no_grad pass (shown, not added: it peaks
    before the continuations' forward starts, with nothing of theirs alive)."""
    types = text["layer_types"]
    full, linear = sum(t == FULL for t in types), sum(t != FULL for t in types)
    kv = 2 * prefix * text["num_key_value_heads"] * text["head_dim"] * b
    gdn = 0
    if linear:  # a family without Gated DeltaNet layers has none of their widths
        key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
        conv_dim = 2 * key + text["linear_num_value_heads"] * text["linear_value_head_dim"]
        state = text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"] * 4
        gdn = state + conv_dim * text["linear_conv_kernel_dim"] * b
    H = text["hidden_size"]
    # a routed layer's widths per token: its shared expert and the k experts it routes to
    I = text.get("intermediate_size") or (text.get("shared_expert_intermediate_size", 0)
                                          + text.get("num_experts_per_tok", 0) * text.get("moe_intermediate_size", 0))
    return [
        Term("prefix_cache", f"P's cache: {full} x K/V {_shape(prefix, 2 * text['num_key_value_heads'] * text['head_dim'])}"
                             f" + {linear} GDN states", full * kv + linear * gdn),
        Term("prefix_pass", f"not added: P's no_grad pass, one layer at {_shape(prefix, I)}", prefix * (2 * H + 3 * I) * b,
             where="compare"),
    ]


@dataclass(frozen=True)
class UnitShape:
    """What one forward holds at most (the plan's largest unit, :func:`packtrain.run.units.unit_shape`): P, each
    continuation's positions and target tokens, the positions of its largest group (None: not in groups), and
    whether P is shared by them (a pack) or not (one example alone). In a prefix tree ``lengths`` are its nodes' and
    ``continuations`` its leaves (what ``packing.max_continuations`` bounds there); else one per continuation."""
    prefix: int
    lengths: list[int]
    targets: list[int]
    group_positions: int | None = None
    shares_prefix: bool = True
    leaves: int | None = None  # a tree's leaves (None: not a tree)
    attention_pairs: int | None = None  # its query-key pairs of causal attention per layer and head (None: a pack's)

    @property
    def continuations(self) -> int:
        return self.leaves if self.leaves is not None else len(self.lengths)


def _plan_estimate(cfg, text: dict, world_size: int, context_grad: str, positions: int, targets: int,
                   continuations: int, prefix: int, group_positions: int | None,
                   savings: StepSavings | None = None) -> MemoryEstimate:
    return estimate(text, positions, targets, dtype=cfg.model.dtype,
                    lora_r=cfg.lora.r, lora_targets=cfg.lora.target_modules, lora_dropout=cfg.lora.dropout,
                    lora_parameters_targets=cfg.lora.target_parameters,
                    modules_to_save=cfg.lora.modules_to_save or (),
                    optimizer=cfg.optim.name, momentum=cfg.optim.momentum,
                    world_size=world_size, continuations=continuations, context_grad=context_grad, prefix=prefix,
                    group_positions=group_positions, savings=savings or savings_for(cfg))


def estimate_for_unit(cfg, shape: UnitShape, world_size: int, context_grad: str | None = None,
                      savings: StepSavings | None = None) -> MemoryEstimate:
    """The estimate for the unit of ``shape`` under ``context_grad`` (default: the config's
    ``packing.context_grad``) and ``savings`` (default: the config's, chosen)."""
    return _plan_estimate(cfg, text_config(config_dict_of(cfg)), world_size, context_grad or cfg.packing.context_grad,
                          shape.prefix + sum(shape.lengths), sum(shape.targets), shape.continuations, shape.prefix,
                          shape.group_positions, savings)
