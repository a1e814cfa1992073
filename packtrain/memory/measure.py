"""`plan --memory --measure`: the per-GPU memory of packtrain's own training step, counted, not estimated.

The config's model is built at its true widths but with one decoder layer of each kind present (a GDN and an
attention layer for Qwen3.5/3.6; dense and MoE MLP layers where a family has both; twice over with part of the layer
inputs offloaded, ``train.offload: N``: the first copy offloaded, the second kept on the device), plus the embedding
and the head, under ``FakeTensorMode``: tensors carry shapes and dtypes, no data and no memory. It is wrapped as
training wraps it (:func:`packtrain.models.wrap.assemble`: LoRA, the patch, checkpointing or offload, with the savings
chosen for the run) and runs one update on the plan's largest unit through the trainer's step on a one-pack plan
(:func:`packtrain.run.harness.one_pack`; :meth:`packtrain.run.step.Step.prepare` builds the unit before the fake mode
counts, then :meth:`~packtrain.run.step.Step.update` runs the unit runner's forward and backward and the optimizer
step). A dispatch mode counts the bytes of every live tensor storage (added when an op first outputs it, dropped when the storage is
freed) and keeps each phase's peak:

- ``forward``: embedding and decoder layers; ``loss``: final norm, head, cross-entropy and their backward, with every
  layer's checkpointed input alive; ``recompute KIND``: one layer's recompute and backward (layers run one at a time);
  ``optimizer``: the step.

Each phase is then extrapolated to the whole model (:func:`extrapolate`): what each measured layer leaves alive
after its forward (its checkpointed input, on the host when offloaded) for every layer of its kind (and offload)
before that moment, the running layer's own input where no earlier layer keeps it, one layer's recompute peak at a
time with the prefetched input of the layer before it where that one is offloaded, and weights, adapters, gradients
and optimizer states for every layer, divided over ``--world-size`` FSDP ranks, with the gathered units of the
estimate.

What runs as on a GPU, on this CPU: the GDN kernels are fla's, counted by shape-only stand-ins that allocate fla's
outputs and save what fla's autograd functions save (:mod:`packtrain.memory.fla_shapes`), not the CPU reference's
per-chunk states; attention is FlexAttention's, a stand-in saving its padded q, k, v, output and log-sum-exp
(:mod:`packtrain.memory.flex_shapes`); LoRA's dropout masks are what packtrain draws on CUDA too (``empty_like(x)``,
the input's dtype). The layout's index tensors are real: an op whose tensor inputs are all real runs for real, so the
index builders work as in training; a scalar read off a fake tensor (the loss's ``.item()``) reads 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from packtrain.config.tiles import offload_layers
from packtrain.models.text_config import FULL, config_dict_of, distinct_kinds, kind_name, reduced_config, text_config

_SCALAR_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}
WEIGHTS, GRADS, STATES, INDEX = "weights", "grads", "states", "index"


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class LiveBytes(TorchDispatchMode):
    """Live tensor storage bytes as ops create and free them, and each phase's peak of what is not a weight, a
    gradient or an optimizer state (``tag``), nor in ``host`` (bytes the caller says are host memory)."""

    def __init__(self, host=lambda: 0):
        super().__init__()
        self.host = host
        self.live: dict[int, int] = {}
        self.tags: dict[int, str] = {}
        self.tagged = {WEIGHTS: 0, GRADS: 0, STATES: 0, INDEX: 0}
        self.index_peak = 0  # real tensors: the layout's index tensors, built once per pack
        self.total = 0
        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self.layer: int | None = None  # the decoder layer whose forward runs now
        self.owner: dict[int, int] = {}  # storage -> the layer whose forward made it

    # -- what is alive
    def activations(self) -> int:
        return self.total - sum(self.tagged.values()) - self.host()

    def _key(self, storage) -> int:
        return storage._cdata

    def track(self, t: torch.Tensor, nbytes: int | None = None) -> None:
        storage = t.untyped_storage()
        key = self._key(storage)
        if key in self.live:
            return
        n = storage.nbytes() if nbytes is None else nbytes
        self.live[key] = n
        self.total += n
        if self.layer is not None:
            self.owner[key] = self.layer
        weakref.finalize(storage, self._free, key)
        if not _is_fake(t):
            self.tags[key] = INDEX
            self.tagged[INDEX] += n
            self.index_peak = max(self.index_peak, self.tagged[INDEX])
        self._peak()

    def _free(self, key: int) -> None:
        n = self.live.pop(key, 0)
        self.total -= n
        self.owner.pop(key, None)
        tag = self.tags.pop(key, None)
        if tag is not None:
            self.tagged[tag] -= n

    def tag(self, t: torch.Tensor, what: str) -> None:
        """Count ``t``'s storage as a weight, gradient or optimizer state from now on."""
        self.track(t)
        key = self._key(t.untyped_storage())
        if self.tags.get(key) != what:
            if key in self.tags:
                self.tagged[self.tags[key]] -= self.live[key]
            self.tags[key] = what
            self.tagged[what] += self.live[key]

    def tag_index(self, tensors) -> None:
        """Count ``tensors`` (what a layout caches for every layer: index tensors, masks) once, apart from any
        layer."""
        for t in tensors:
            self.tag(t, INDEX)
        self.index_peak = max(self.index_peak, self.tagged[INDEX])

    def owned(self, layer: int, but=()) -> int:
        """Bytes alive now that ``layer``'s forward made (``but``: tensors not to count)."""
        skip = {self._key(t.untyped_storage()) for t in but if t is not None}
        return sum(self.live[k] for k, o in self.owner.items() if o == layer and k not in skip and k not in self.tags)

    # -- phases
    def set_phase(self, name: str) -> None:
        self.phase = name
        self._peak()

    def _peak(self) -> None:
        now = self.activations()
        if now > self.peaks.get(self.phase, -1):
            self.peaks[self.phase] = now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if func in _SCALAR_OPS and any(_is_fake(t) for t in tensors):
            return False if tensors[0].dtype == torch.bool else 0  # a fake tensor has no value to read
        if tensors and not any(_is_fake(t) for t in tensors):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():  # index builders: real inputs, real results
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        self._peak()
        return out


@dataclass
class LayerRecord:
    kind: tuple
    offloaded: bool = False  # its input in host memory (train.offload)
    before: int = 0  # activation bytes when its forward starts
    kept: int = 0  # what its forward made that is alive when the final norm starts (what it keeps for backward:
    # the next layer's checkpointed input, or all its saved tensors without checkpointing)
    own: int = 0  # kept, but its output (the next layer's input) left out
    output_bytes: int = 0  # its output, [T, H]
    peak: int = 0  # the peak during its forward
    host: int = 0  # host bytes its forward added (train.offload: its input's chunks)
    weights: int = 0  # its parameters' bytes (frozen)
    adapters: int = 0  # its trainable parameters' bytes
    phase: str = ""  # its backward's phase while measured


@dataclass
class Measured:
    """Measured on the reduced model (``layers``: one per kind, in order), before extrapolation."""
    peaks: dict[str, int]  # phase -> peak activation bytes (device)
    layers: list[LayerRecord]
    weights: int  # frozen parameter bytes of the reduced model
    adapters: int  # trainable parameter bytes of the reduced model
    states: int  # optimizer state bytes after the step
    head_weights: int  # the embedding / head: the largest vocabulary matrix (a gathered unit under FSDP)
    index: int = 0  # the layout's index tensors at most (built once per pack, kept with it)
    notes: list[str] = field(default_factory=list)


def _storage_bytes(tensors) -> int:
    seen, n = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s._cdata not in seen:
            seen.add(s._cdata)
            n += s.nbytes()
    return n


def measure_backend(cfg):
    """The kernels the step runs on CUDA, on this CPU: fla's GDN and FlexAttention (stand-ins), the dense MLP and the
    norms in the tiles ``train.mlp_chunk_rows`` and ``train.norm_chunk_rows`` (chosen) give on CUDA."""
    from packtrain.packed.kernels import select_backend

    cuda = select_backend("torch", "cuda", mlp_chunk_rows=cfg.train.mlp_chunk_rows,
                          norm_chunk_rows=cfg.train.norm_chunk_rows)
    return dataclasses.replace(cuda, gdn="fla", attention="flex")


@contextlib.contextmanager
def _fake_build():
    """Building and wrapping a model of fake tensors, two places of torch that read a tensor's memory are steered
    off it: ``nn.Module.to`` swaps a fake parameter for its converted copy, and the swap refuses a tensor the fake mode
    holds a weak reference to, so ``.data`` is set instead (the same parameter, its new fake value); and
    ``copy.deepcopy`` (peft's ``modules_to_save``) copies a fake tensor's storage bytes, which do not exist, so it
    clones instead."""
    from torch._subclasses.fake_tensor import FakeTensor

    swap, deepcopy = torch.utils.swap_tensors, FakeTensor.__deepcopy__

    def set_data(t1, t2):
        if t2.untyped_storage()._cdata != t1.untyped_storage()._cdata:  # .to to the same dtype returns the tensor
            t1.data = t2.data if isinstance(t2, torch.nn.Parameter) else t2

    def clone(self, memo):
        new = self.detach().clone().requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        memo[id(self)] = new
        return new

    torch.utils.swap_tensors, FakeTensor.__deepcopy__ = set_data, clone
    try:
        yield
    finally:
        torch.utils.swap_tensors, FakeTensor.__deepcopy__ = swap, deepcopy


def _offloaded(cfg, layers: int) -> int:
    return offload_layers(cfg.train.offload, layers)


def _reduced_cfg(cfg, layers: int):
    """The reduced model's config: each kind once (twice when part of the layer inputs are offloaded: the first copy
    offloaded, the second kept), its offload the copies' to match."""
    offloaded = _offloaded(cfg, layers)
    partial = 0 < offloaded < layers
    raw = reduced_config(cfg, 2 if partial else 1)
    kinds = len(distinct_kinds(text_config(raw)))  # the first copy's layers
    # the start adapter's weights change no shape: the reduced model is a random init of its own, without one
    model = dataclasses.replace(cfg.model, config=raw, path=None, adapter=None, kernels="torch")
    train = dataclasses.replace(cfg.train, offload=kinds if offloaded else 0)
    return dataclasses.replace(cfg, model=model, train=train)


def _without_images(examples):
    return [dataclasses.replace(ex, images=()) if getattr(ex, "images", ()) else ex for ex in examples]


def text_only(examples) -> tuple[list, list[str]]:
    """The examples with their images dropped, and the note saying so (the vision tower is not counted)."""
    if not any(getattr(ex, "images", ()) for ex in examples):
        return examples, []
    return _without_images(examples), ["the vision tower is left out (frozen, small): image tokens run as text tokens"]


def reduced_cfg(cfg):
    """The config of the model :func:`count_update` counts: one decoder layer of each kind (see :func:`_reduced_cfg`)."""
    return _reduced_cfg(cfg, text_config(config_dict_of(cfg))["num_hidden_layers"])


@contextlib.contextmanager
def fake_tensors():
    """Fake tensors, fla's and FlexAttention's shape-only stand-ins, and the build's steering (:func:`_fake_build`):
    what the model is built and its update run under."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from packtrain.memory import fla_shapes, flex_shapes

    with FakeTensorMode(allow_non_fake_inputs=True), fla_shapes.installed(), flex_shapes.installed(), _fake_build():
        yield


def count_update(cfg, model, lm, step, ready, notes: list[str]) -> Measured:
    """The update ``step.update(ready, 0)`` of the model built under :func:`fake_tensors` (the reduced model of
    :func:`reduced_cfg`), its live bytes counted per phase. The caller runs it (:func:`packtrain.run.harness.measure_step`:
    the trainer's step on a one-pack plan)."""
    from packtrain.models.offload import OffloadedCheckpoint
    from packtrain.packed.patch import text_parts

    text = text_config(reduced_cfg(cfg).model.config)
    text_model, lm_head = text_parts(model)
    layers = list(text_model.layers)
    params, optimizer = step.params, step.optimizer
    offloaded = [isinstance(l, OffloadedCheckpoint) and l.offload for l in layers]
    pools = {id(l.pool): l.pool for l in layers if isinstance(l, OffloadedCheckpoint)}.values()
    counter = LiveBytes(host=lambda: sum(p.allocated_bytes for p in pools))
    records = [LayerRecord(tuple(k), off) for k, off in zip(text["kinds"], offloaded)]
    for i, layer in enumerate(layers):
        rec = records[i]
        rec.weights = _storage_bytes(p for p in layer.parameters() if not p.requires_grad)
        rec.adapters = _storage_bytes(p for p in layer.parameters() if p.requires_grad)
    weights = _storage_bytes(p for p in lm.parameters() if not p.requires_grad)
    adapters = _storage_bytes(params)
    head = max(_storage_bytes(text_model.embed_tokens.parameters()), _storage_bytes(lm_head.parameters()))
    hooks = phase_hooks(counter, layers, records, text, bool(cfg.train.activation_checkpointing or
                                                              cfg.train.offload), text_model.norm)
    with counter:
        for p in lm.parameters():
            counter.tag(p, WEIGHTS)
        for b in lm.buffers():
            counter.tag(b, WEIGHTS)
        for p in params:
            hooks.append(p.register_post_accumulate_grad_hook(lambda p: counter.tag(p.grad, GRADS)))

        def before_step(opt, *_):
            counter.set_phase("optimizer")

        def after_step(opt, *_):
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        counter.tag(v, STATES)

        hooks += [optimizer.register_step_pre_hook(before_step), optimizer.register_step_post_hook(after_step)]
        counter.set_phase("forward")
        step.update(ready, 0)
        states = sum(_storage_bytes([v]) for s in optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor))
    for h in hooks:
        h.remove()
    return Measured(dict(counter.peaks), records, weights, adapters, states, head, counter.index_peak, list(notes))


def _cached_tensors(layouts) -> list[torch.Tensor]:
    """The tensors layouts cache for their layers (``PackLayout._cache``: index tensors, bucket masks)."""
    found, todo = [], [lay._cache for lay in layouts]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif dataclasses.is_dataclass(x):
            todo.extend(vars(x).values())
    return found


def phase_hooks(counter: LiveBytes, layers, records, text, recompute: bool, final_norm) -> list:
    """Forward hooks on each decoder layer (its wrapper: the recompute calls what is inside) that keep its
    record, and a hook on its output's gradient that starts its backward phase. A layer's input is alive until its
    call returns, so what it leaves is read when the next layer (or the final norm) starts."""
    from packtrain.packed.patch import LAYOUT_KWARG

    hooks = []
    name = "recompute" if recompute else "backward"
    twice = len({r.kind for r in records}) < len(records)  # each kind offloaded and kept: a phase per layer
    for i, rec in enumerate(records):
        rec.phase = f"{name} {kind_name(text, rec.kind)}" + (f" #{i}" if twice else "")
    layouts = {}  # the layouts the layers run on (the unit runner's, moved to the device)
    outputs = {}  # layer -> its output (weakly: only to tell its storage apart at the final norm)

    def at_norm(module, args):
        if torch._C._current_graph_task_id() != -1:
            return
        counter.tag_index(_cached_tensors(layouts.values()))  # built by the first layer of a kind, kept for all
        for i, rec in enumerate(records):
            out = outputs.get(i)
            out = out() if out is not None else None
            rec.kept = counter.owned(i, but=[args[0]])
            rec.own = counter.owned(i, but=[args[0], out])

    def pre(i):
        def hook(module, args, kwargs):
            if torch._C._current_graph_task_id() != -1:  # a recompute inside backward
                return
            counter.set_phase("forward")
            layout = getattr(kwargs.get(LAYOUT_KWARG), "layout", None)  # a pack's PackPass carries its layout
            if layout is not None:
                layouts[id(layout)] = layout
            counter.layer = i
            records[i].before = counter.activations()
            records[i].host = counter.host()
            counter.peaks["_layer"] = records[i].before
            counter.phase = "_layer"
        return hook

    def post(i):
        def hook(module, args, kwargs, out):
            if torch._C._current_graph_task_id() != -1:
                return
            rec = records[i]
            counter.layer = None
            rec.peak = counter.peaks.pop("_layer", counter.activations())
            rec.host = counter.host() - rec.host
            counter.phase = "forward"
            counter.peaks["forward"] = max(counter.peaks.get("forward", 0), rec.peak)
            hidden = out[0] if isinstance(out, tuple) else out
            if isinstance(hidden, torch.Tensor):
                outputs[i] = weakref.ref(hidden)
                rec.output_bytes = hidden.untyped_storage().nbytes()
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(lambda g: counter.set_phase(rec.phase))
            if i == len(layers) - 1:
                counter.set_phase("loss")
        return hook

    hooks.append(final_norm.register_forward_pre_hook(at_norm))
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        hooks.append(layer.register_forward_hook(post(i), with_kwargs=True))
    return hooks


@dataclass
class WholeModel:
    """The measured step extrapolated to the whole model, per GPU: ``plan --measure``'s figure."""
    phases: dict[str, int]  # phase -> peak device bytes
    host: int  # checkpointed layer inputs in host memory (train.offload)
    static: dict[str, int]  # weights, adapters (+ gradients, optimizer states), gathered units
    notes: list[str] = field(default_factory=list)  # how it was measured

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def as_json(self) -> dict:
        return {"peak_device_bytes": self.peak, "peak_phase": self.peak_phase, "phases": self.phases,
                "host_bytes": self.host, "notes": self.notes}


def extrapolate(m: Measured, text: dict, world: int, offloaded: int = 0, checkpointing: bool = True) -> WholeModel:
    """From the reduced model's phases to the model's ``text["kinds"]``, per GPU at ``world`` FSDP ranks, the first
    ``offloaded`` layers' inputs in host memory (the reduced model's offloaded layers stand for those, its kept ones
    for the others)."""
    kinds = [tuple(k) for k in text["kinds"]]
    L = len(kinds)
    rec = {(r.kind, r.offloaded): (i, r) for i, r in enumerate(m.layers)}
    full = [rec[(k, j < offloaded)] for j, k in enumerate(kinds)]  # (measured index, record) per layer
    out = m.layers[0].output_bytes  # a layer's input or output, [T, H]
    offloaded_measured = [r.offloaded for r in m.layers]

    def kept_full(j: int) -> int:
        r = full[j][1]
        if not checkpointing:
            return r.kept - r.host
        # its output is kept by the next layer when that one keeps its input on the device
        return r.own - r.host + (out if j + 1 < L and j + 1 >= offloaded else 0)

    def prefetched(offloaded_before: bool, j: int) -> int:
        return out if checkpointing and j >= 1 and offloaded_before else 0

    before_full, acc = [], 0  # what earlier layers leave alive when layer j starts
    for j in range(L):
        before_full.append(acc)
        acc += kept_full(j)
    kept_total = acc
    before_measured, acc = [], 0
    for r in m.layers:
        before_measured.append(acc)
        acc += r.kept - r.host
    kept_measured = acc
    base = m.layers[0].before
    # an offloaded layer's own input is on the device while it runs, and no earlier layer keeps it
    running = [out if checkpointing and 1 <= j < offloaded else 0 for j in range(L)]
    phases = {"forward": max(base + before_full[j] + r.peak - r.before + running[j]
                             for j, (_, r) in enumerate(full))}
    if "loss" in m.peaks:
        phases["loss"] = m.peaks["loss"] - kept_measured + kept_total
    for j, (i, r) in enumerate(full):
        if r.phase not in m.peaks:
            continue
        name = r.phase.split(" #")[0]
        adjust = prefetched(j - 1 < offloaded, j) - prefetched(i >= 1 and offloaded_measured[i - 1], i)
        value = m.peaks[r.phase] - before_measured[i] + before_full[j] + adjust
        phases[name] = max(phases.get(name, 0), value)
    weights = m.weights - sum(r.weights for r in m.layers) + sum(r.weights for _, r in full)
    adapters = m.adapters - sum(r.adapters for r in m.layers) + sum(r.adapters for _, r in full)
    ratio = adapters / m.adapters if m.adapters else 0.0
    states = round(m.states * ratio)
    static = {"weights": -(-weights // world), "adapters": -(-(2 * adapters + states) // world)}
    if "optimizer" in m.peaks:
        phases["optimizer"] = round(max(0, m.peaks["optimizer"] - m.states) * ratio / world)
    layer = max(r.weights + r.adapters for r in m.layers)
    gathered = {p: 0 for p in phases}
    if world > 1:  # FSDP: two decoder layers (one running, one prefetched), or the head and one layer
        gathered = {p: (0 if p == "optimizer" else m.head_weights + layer if p == "loss" else 2 * layer)
                    for p in phases}
    total = {p: v + static["weights"] + static["adapters"] + gathered[p] + (0 if p == "optimizer" else m.index)
             for p, v in phases.items()}
    host = sum(r.host for _, r in full[:offloaded])
    static["gathered"] = max(gathered.values())
    return WholeModel(total, host, static)


GDN_NOTE = ("Gated DeltaNet: fla's kernels as on CUDA, counted by shape-only stand-ins saving what fla's autograd "
            "functions save (not the CPU reference's per-chunk states)")


def measure_whole(cfg, m: Measured, world: int) -> WholeModel:
    """The whole model's memory per rank at ``world`` ranks from the reduced model's count ``m``
    (:func:`packtrain.run.harness.measure_step`); ``cfg``: the savings chosen (nothing auto)."""
    text = text_config(config_dict_of(cfg))
    whole = extrapolate(m, text, world, _offloaded(cfg, text["num_hidden_layers"]),
                        bool(cfg.train.activation_checkpointing or cfg.train.offload))
    notes = list(m.notes)
    if any(k[0] != FULL for k in (r.kind for r in m.layers)):
        notes.insert(0, GDN_NOTE)
    notes.append("attention: FlexAttention as on CUDA, counted by a stand-in saving its padded q, k, v, output and "
                 "log-sum-exp; LoRA's dropout masks in the input's dtype, as packtrain draws them on CUDA")
    notes.append(f"one layer of each kind run under fake tensors, extrapolated to {len(text['kinds'])} layers "
                 f"and {world} rank{'s' * (world != 1)}")
    return dataclasses.replace(whole, notes=notes)
