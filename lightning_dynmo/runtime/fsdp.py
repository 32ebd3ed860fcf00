"""FSDP2 inside each pipeline stage (``dp_sharding="fsdp"``): parameters, gradients and optimizer
state sharded over the stage's data-parallel replicas with torch's ``fully_shard``.

Composition follows torchtitan's PP x FSDP2: every pipeline layer is one FSDP unit
(``fully_shard(layer, mesh=dp_mesh)``) and the module a pipeline stage runs is the FSDP root
(:meth:`ShardedLayers.wrap_stage`). ``torch.distributed.pipelining`` recognises the root: it
turns gradient reduction off for all but the last micro-batch's backward
(``backward_maybe_with_nosync``) and, after the last, runs FSDP's post-backward
(``perform_reduce_grad``), one reduce-scatter per layer and step. Its multi-stage schedules
insert the UNSHARD/RESHARD actions themselves.

Two things are ours, because our stages are not fixed:

* Stage modules are rebuilt whenever layers move (and one exists per cached engine), while a
  layer's FSDP state remembers the first root it ran under. Before a new root is made, the
  layers' states are marked un-initialised again (``_is_root = None``, FSDP2's own "not yet lazily
  initialised" mark), so the new root adopts them on its first forward.
* A layer that changes stage leaves as a plain module with whole tensors: :meth:`ShardedLayers.gather`
  all-gathers its parameters, gradients and optimizer state (``DTensor.full_tensor()``, a
  collective over the sending stage's replicas) into a fresh copy of the layer recorded before it
  was sharded, and the receiving stage shards it again (:meth:`ShardedLayers.shard`), cutting
  every tensor to this rank's ``Shard(0)`` piece locally (every replica received the same layer).
  Migration itself (``runtime/migration.py``) is unchanged.

Layers keep their parameters gathered from their forward to the step's end
(``reshard_after_forward=False``, torchtitan's choice under PP: one all-gather per layer and step
instead of one per micro-batch). Zero-bubble schedules need it: their input-gradient pass looks up
the weights' autograd nodes from ``submod.parameters()``, which after a reshard would be the
sharded parameters, not the gathered ones the graph used (gradients were lost). The schedule
reshards after the last backward (``perform_reduce_grad`` / its RESHARD actions).

A parameter can get a gradient on one replica and none on another (MoE routing that sends a
replica's tokens past an expert, early exit, MoD, a branch taken on some batches). FSDP2 then
reduce-scatters different lists of gradients on the two replicas (or one replica skips the
layer's reduce-scatter): mismatched collectives, a hang or garbage. Every unit therefore
reduce-scatters zeros for a trainable parameter without a gradient
(``set_reduce_scatter_unused_params``, torch's counterpart of DDP's ``find_unused_parameters``),
which is what ``replicate`` computes too (an absent gradient counts as zero in the replicas'
average). Frozen parameters (``requires_grad=False``) are left out on every replica alike.

Those zeros must not outlive the reduce-scatter where *no* replica had a gradient (an expert no
token reached, the layers past an early exit, a weight no forward uses): one process leaves such
a parameter's ``.grad`` at ``None``, so AdamW creates no state for it, does not decay it and does
not count the step. Each unit's post-backward therefore first notes which parameters have a
gradient of their own (:meth:`ShardedLayers.watch`, the same test FSDP2 makes before it
substitutes zeros), and in the batch's ``backward`` (every rank has passed the step's problem
check by then) :meth:`ShardedLayers.drop_never_graded` agrees on them in one small all-reduce
over the dp group (a flag per local parameter; every replica holds the same layers in the same
order) and sets ``.grad = None`` where no replica had one. Per batch, so under gradient
accumulation a parameter graded in any batch of the window keeps that batch's gradient (the
window adds it to the others'), and a layer that moves mid-window carries ``None`` exactly where
one process would have it. Clipping is unaffected: zeros add nothing to the global norm.

Expert parallelism (``expert_parallel > 1``) stays as under ``replicate`` for the experts, like
HSDP: replica ``d`` holds expert shard ``d % ep`` of each MoE layer (``runtime/expert_parallel.py``),
and only the *dense* parameters (attention, norms, routers, embedding, head) are FSDP-sharded over
the stage's replicas. Each layer is cut to its expert shard first, then made a unit with those
shards left out (``fully_shard(..., ignored_params=...)``): they stay plain tensors that the
layer's forward uses as they are (tokens reach them by all-to-all), and sharding them again over
the same replicas would add an all-gather of experts that the dispatch exists to avoid. Their
gradients are reduced as under ``replicate``, at the accumulation window's exchange: summed over
the replicas holding the same shard, divided by ``dp``
(:func:`~lightning_dynmo.runtime.gradients.average_expert_shards`), with the same presence
agreement for a shard that got a gradient on some of those replicas only; the never-graded rule
above covers the units' parameters (expert shards keep ``replicate``'s rule). Clipping counts each
FSDP shard once (its norm made whole over the dp mesh) and each expert shard once (over its
expert peers). A migrated layer is gathered and re-sharded with its expert shard untouched (each
replica's pipeline moves it replica ``d`` to replica ``d``). What this changes in memory: the
dense parameters' state drops to ``1/dp`` per rank; the experts' stays ``1/ep`` as under
``replicate``. One consequence: an optimizer step sees DTensors beside plain tensors, which
torch's foreach and fused kernels refuse (:func:`check_expert_shard_optimizers`), and the grad
scaler unscales the gradients' local tensors (``runtime/precision.py``).

Freezing (``LayerFreezing``) works on the units in place: FSDP2 copies a sharded parameter's
``requires_grad`` to its unsharded one at every all-gather, so a frozen layer's parameters build
no graph and get no gradient, and :func:`~lightning_dynmo.dynamic.freeze_layer` pops their
optimizer state (the frozen shards carry none).

Gradual pruning works on the units in place while a layer is dense-stored. A module may declare
buffers laid out like one of its parameters (``buffers_sharded_like``: a pruning mask and its
weight); :meth:`ShardedLayers.shard` cuts them to the parameter's ``Shard(0)`` piece and
:meth:`ShardedLayers.gather` makes them whole with the layer. A pruned layer then runs masked dense
on its all-gathered weight: its shards hold zeros where pruned, and its gradient shard is masked
after the reduce-scatter (:class:`~lightning_dynmo.dynamic.PrunableLinear`). The global magnitude
threshold counts each replica's shards and sums over the dp group and the pipeline, which is one
process's count. A layer that becomes CSR-stored (or, CSR-stored, is pruned further) swaps its
weight for the kept values, which a unit cannot adopt: the pruning callback gathers it whole
(:meth:`ShardedLayers.gather`), changes its storage as under ``replicate`` and shards it again
(:meth:`ShardedLayers.shard`), so the values vector, its gradient and its moments are ``1/dp``
shards and the CSR pattern is whole on every replica (docs/parallelism.md).

Precision: ``bf16-mixed`` and ``16-mixed`` are autocast over fp32 parameters, so shards,
reduce-scattered gradients and optimizer state stay fp32 and the math is ``replicate``'s (FSDP2's
``MixedPrecisionPolicy`` is not used: bf16 all-gathers would change it). A grad scaler's inf check
is agreed over the replicas too (``runtime/precision.py``): each replica checks a different shard.
``bf16-true`` shards bf16 parameters.

Tied parameters (a tied embedding and LM head) are sharded like the others: each stage's unit
shards its end over the stage's replicas, the tied group sums the shards once per shard index,
and where both ends are on one rank the later one mirrors the first one's shard
(:mod:`.fsdp_tied`; :meth:`ShardedLayers.gather` makes a moving layer's local tied partners
whole with it, and :meth:`ShardedLayers.shard` shards them again).

The optimizer keeps its groups and positions: each parameter is swapped in place
(:func:`~lightning_dynmo.runtime.optimizer_layout.replace_param`), so Adam's ``exp_avg`` becomes
a DTensor shard of the same values, and ``step`` is kept.
"""
from __future__ import annotations

import copy
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from ..protocol import RemoteLayer
from ..protocol.layer_init import initialise_layer, layer_tensors
from .expert_parallel import ExpertParallel
from .fsdp_tied import share_mirror_shards, tied_partners, untie_before_sharding
from .materialize import rebind_optimizers
from .migration import _meta_skeleton
from .optimizer_layout import OptimizerLayout
from .tied import TiedParameters


def is_sharded(t) -> bool:
    return isinstance(t, DTensor)


def whole(t):
    """``t`` as a plain whole tensor (a DTensor is all-gathered over its mesh: collective). A bool
    shard (a pruning mask) travels as bytes: not every backend all-gathers bool."""
    if not isinstance(t, DTensor):
        return t
    if t.dtype == torch.bool:
        return t.to(torch.uint8).full_tensor().bool()
    return t.full_tensor()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def shard_like(t: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's piece of the whole tensor ``t`` laid out as ``like`` (no communication: every
    rank of the mesh holds the same ``t``)."""
    if isinstance(t, DTensor):
        return t
    return distribute_tensor(t.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def dp_mesh(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The 1-D mesh of this stage's data-parallel group (the dp dimension of the (pp, dp) grid)."""
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))


def shard_buffers(layer: nn.Module) -> None:
    """Cut each buffer that a sub-module of ``layer`` declares laid out like one of its parameters
    (``buffers_sharded_like() -> {buffer: parameter}``, e.g. a pruning mask and its weight) to this
    rank's piece of that parameter's shard (no communication). FSDP2 shards parameters only."""
    for module in layer.modules():
        like = getattr(module, "buffers_sharded_like", None)
        if not callable(like):
            continue
        for buf, param in like().items():
            b, p = module.get_buffer(buf), module.get_parameter(param)
            if isinstance(p, DTensor) and not isinstance(b, DTensor):
                module.register_buffer(buf, shard_like(b, p), persistent=buf not in module._non_persistent_buffers_set)


def adopt_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` into ``module``'s buffer ``name``: copied where the shapes agree, else
    registered anew (a buffer whose shape changed since the layer was sharded: a sparse kernel's
    CSR transpose built later)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    current = owner._buffers.get(leaf)
    if current is not None and current.shape == value.shape and current.dtype == value.dtype:
        current.copy_(value)
    else:
        owner.register_buffer(leaf, value.to(current.device if current is not None else value.device).clone(),
                              persistent=leaf not in owner._non_persistent_buffers_set)


#: what every nn.Module keeps in its ``__dict__`` (parameters, buffers, children, hooks): not a layer's own state
_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}


def copy_attributes(src: nn.Module, dst: nn.Module) -> None:
    """Each sub-module's plain attributes from the live layer ``src`` onto ``dst``, its copy from
    before sharding: what callbacks and forwards changed since (an annealed MoD capacity, an
    early-exit threshold, routing counters), which a migration under ``replicate`` carries as it
    copies the live layer. Only attributes ``dst``'s modules have: FSDP2's own stay behind."""
    memo: dict[int, object] = {id(p): dst.get_parameter(n) for n, p in src.named_parameters()}
    memo.update({id(b): dst.get_buffer(n) for n, b in src.named_buffers()})
    for name, module in src.named_modules():
        target = vars(dst.get_submodule(name))
        for key, value in vars(module).items():
            if key in target and key not in _MODULE_INTERNALS:
                target[key] = copy.deepcopy(value, memo)


class ShardedLayers:
    """This rank's pipeline layers as FSDP units over the stage's data-parallel mesh."""

    def __init__(self, mesh: DeviceMesh, layers: nn.ModuleList, layers_attr: str, module: nn.Module,
                 optimizers, optimizer_layout: OptimizerLayout | None,
                 expert_parallel: ExpertParallel | None = None, tied: TiedParameters | None = None) -> None:
        self.mesh = mesh
        self.expert_parallel = expert_parallel
        self.tied = tied if tied else None  # parameters shared by layers (runtime/fsdp_tied.py)
        self._partners: set[int] = set()  # tied partners made whole for a migration, sharded again after it
        self.layers = layers
        self.layers_attr = layers_attr
        self.module = module
        self.optimizers = list(optimizers)
        self.optimizer_layout = optimizer_layout
        self._plain: dict[int, nn.Module] = {}  # layer index -> its structure before sharding (meta)
        self._graded: set[int] = set()  # ids of sharded parameters that had a local gradient this batch

    def _prefix(self, i: int) -> str:
        return f"{self.layers_attr}.{i}."

    def shard(self, indices: Iterable[int]) -> None:
        """Make each layer in ``indices`` an FSDP unit; its gradients and optimizer state become
        this rank's shards (no communication). Under expert parallelism the layer first keeps only
        this rank's expert shard, which the unit leaves out (see the module docstring)."""
        indices = set(indices) | {i for i in self._partners if not isinstance(self.layers[i], RemoteLayer)}
        self._partners = set()
        for i in sorted(indices):
            layer = self.layers[i]
            if isinstance(layer, FSDPModule):
                continue
            if self.tied:
                untie_before_sharding(self.tied, self.layers, i)
            # left out of the unit: expert shards, and empty parameters (a CSR layer pruned to nothing),
            # which FSDP2's reduce-scatter cannot take; both stay plain tensors on every replica
            kept_plain = self._expert_shards(i) | {p for p in layer.parameters() if p.numel() == 0}
            before = dict(layer.named_parameters())
            self._plain[i] = _meta_skeleton(layer)
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=False, ignored_params=kept_plain or None)
            layer.set_reduce_scatter_unused_params(True)  # see the module docstring: unused parameters
            self.watch(layer)
            shard_buffers(layer)
            for name, p in layer.named_parameters():
                old = before[name]
                if p is old:  # an expert shard or an empty parameter: not FSDP's
                    continue
                if old.grad is not None:
                    p.grad = shard_like(old.grad, p)
                    old.grad = None
                if self.optimizer_layout is not None:
                    self.optimizer_layout.replace_param(self.optimizers, self._prefix(i) + name, old, p,
                                                        lambda t, p=p: shard_like(t, p))
        if self.tied:
            share_mirror_shards(self.tied, self.layers)

    def materialize_in_shards(self, module: nn.Module, i: int, device: torch.device) -> bool:
        """Make meta layer ``i`` an FSDP unit first, then allocate only this rank's shards on
        ``device`` and let ``module`` fill them (its ``init_pipeline_layer`` draws the rows of its
        single-process values: ``initializes_shards``), so the layer is never whole on this rank.
        False, doing nothing, where that does not apply: the module cannot fill shards, the layer
        is not all on the meta device, or it holds expert shards or tied parameters (cut first,
        on whole tensors); the caller then allocates it whole and shards it after."""
        layer = self.layers[i]
        tensors = [t for _, t in layer_tensors(layer)]
        if (not getattr(module, "initializes_shards", False) or not tensors or not all(t.is_meta for t in tensors)
                or self.expert_parallel is not None or self.tied):
            return False
        self.shard([i])  # on the meta device: units, and optimizer slots re-mapped to the (meta) shards
        before = dict(layer.named_parameters())
        layer.to_empty(device=device)  # FSDP2 allocates each shard (and each buffer whole)
        rebind_optimizers(self.optimizers, {before[n]: p for n, p in layer.named_parameters() if p is not before[n]})
        initialise_layer(module, i, layer, [t for _, t in layer_tensors(layer)])
        return True

    def _expert_shards(self, i: int) -> set[nn.Parameter]:
        """Layer ``i``'s expert shards, cut first if the layer still holds whole experts (built at
        setup; a migrated layer arrives with its shard), its optimizer slots following."""
        if self.expert_parallel is None:
            return set()
        layer = self.layers[i]
        self.expert_parallel.shard_module(layer, self.optimizers, self.optimizer_layout, self._prefix(i))
        return set(self.expert_parallel.sharded_parameters(layer).values())

    def watch(self, unit: FSDPModule) -> None:
        """Note, at each of ``unit``'s post-backwards and before FSDP2 reduces, which of its
        parameters have a gradient of their own (not the zeros it reduce-scatters for the others)."""
        groups = getattr(fully_shard.state(unit), "_fsdp_param_groups", None)
        if groups is None or not all(hasattr(g, "post_backward") and hasattr(g, "fsdp_params") for g in groups):
            raise RuntimeError(f"torch {torch.__version__}: FSDP2's per-unit post-backward is not where "
                               "dp_sharding='fsdp' notes which parameters got a gradient (FSDPState._fsdp_param_groups"
                               "[i].post_backward / .fsdp_params); use dp_sharding='replicate' with this torch")
        for group in groups:
            real = group.post_backward

            def post_backward(*args, group=group, real=real):
                for fp in group.fsdp_params:
                    if fp.unsharded_accumulated_grad is not None or (
                            hasattr(fp, "_unsharded_param") and fp.unsharded_param.grad is not None):
                        self._graded.add(id(fp.sharded_param))
                return real(*args)

            group.post_backward = post_backward

    def drop_never_graded(self, group) -> None:
        """After a batch's schedule, before its gradients join the accumulation window's:
        ``.grad = None`` for each parameter that no replica of ``group`` (the stage's dp group)
        produced a gradient for (one all-reduce of a flag per parameter; collective). Expert
        shards are not the units' (each replica holds other experts): they are left as they are."""
        params = [p for layer in self.layers if isinstance(layer, FSDPModule)
                  for p in layer.parameters() if p.grad is not None and is_sharded(p)]
        graded, self._graded = self._graded, set()
        if not params:
            return
        flags = torch.tensor([float(id(p) in graded) for p in params], device=_local(params[0].grad).device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        for p, anywhere in zip(params, flags.tolist()):
            if not anywhere:
                p.grad = None

    def gather(self, indices: Iterable[int], device: torch.device, arriving: Iterable[int] = ()) -> None:
        """Replace each sharded layer in ``indices`` by a plain copy holding the whole parameters,
        gradients and optimizer state. Collective over the data-parallel group (every replica of
        the stage gathers the same layers in the same order). The local layers sharing a tied
        parameter with these or the ``arriving`` ones are made whole too (one plain parameter, as
        the migration expects) and sharded again at the next :meth:`shard`."""
        indices = set(indices)
        if self.tied:
            partners = tied_partners(self.tied, self.layers, indices | set(arriving))
            self._partners |= partners - indices
            indices |= partners
        for i in sorted(indices):
            layer = self.layers[i]
            if not isinstance(layer, FSDPModule):
                continue
            layer.reshard()  # a root left unsharded after an eval forward: the DTensor shards are the truth
            plain = self._plain.pop(i).to_empty(device=device)
            copy_attributes(layer, plain)
            params = dict(plain.named_parameters())
            for name, b in layer.named_buffers():
                adopt_buffer(plain, name, whole(b))
            for name, p in layer.named_parameters():
                q = params[name]
                with torch.no_grad():
                    q.copy_(whole(p))
                q.requires_grad_(p.requires_grad)
                if p.grad is not None:
                    q.grad = whole(p.grad)
                if self.optimizer_layout is not None:
                    self.optimizer_layout.replace_param(self.optimizers, self._prefix(i) + name, p, q, whole)
            self.layers[i] = plain
        if self.tied:  # the mirrors' copies become the first user's parameter again
            self.tied.merge_local_gradients(self.layers)
            self.tied.tie_local(self.layers, self.optimizers, only=indices)

    def wrap_stage(self, submod: nn.Module) -> nn.Module:
        """Make ``submod`` (a stage's layers) the FSDP root of its layers' units, so torch's
        pipeline schedules reduce gradients once per step (see the module docstring)."""
        for m in submod.modules():
            if m is not submod and isinstance(m, FSDPModule):
                fully_shard.state(m)._is_root = None  # adopted by this root at its first forward
        fully_shard(submod, mesh=self.mesh, reshard_after_forward=True)
        return submod

#: Tested under fsdp (test_fsdp_precision.py): fp32, autocast over fp32 parameters (the shards,
#: gradients and optimizer state stay fp32) and bf16 parameters sharded as bf16.
FSDP_PRECISIONS = ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true")


def missing_fsdp_capability() -> str | None:
    """Why this torch cannot run ``dp_sharding="fsdp"`` (``None``: it can). Checked by capability:
    the unused-parameter guard (``FSDPModule.set_reduce_scatter_unused_params``, see the module
    docstring) is in torch 2.13 and 2.14, not in 2.10, 2.11 or 2.12; without it the replicas'
    reduce-scatters can mismatch (gloo aborts, NCCL hangs or reduces garbage).

    Bridging the guard is not enough there. Zeros put in the unused parameters' ``.grad`` before
    the unit's post-backward (what 2.13 reduce-scatters) made the unused-parameter, repack,
    meta-init and migrate-every-step tests pass on torch 2.11, but under layer freezing 2.11's
    FSDP2 reduce-scattered different shards than 2.13 from identical unsharded gradients on both
    replicas (lm_head's reduced shard norm 1.0272 vs 1.0178 at the step after the freeze; the
    final weights 5e-4 apart; ``replicate`` is equal on both torches). A silent wrong answer, so
    these torches keep the refusal."""
    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        return None
    return (f"torch {torch.__version__} (its FSDP2 lacks FSDPModule.set_reduce_scatter_unused_params, which keeps "
            "the replicas' reduce-scatters matched when a parameter gets a gradient on one replica only; torch 2.13 "
            "has it)")


def check_expert_shard_optimizers(optimizers, device: torch.device) -> None:
    """Under expert parallelism a sharded stage holds DTensor shards beside plain expert shards,
    and torch's foreach and fused optimizer kernels (one call per group, device and dtype) refuse
    the mix at the first step; refused at setup instead, naming the fix. ``foreach=None`` picks
    the foreach kernels on every device but the CPU."""
    for o, opt in enumerate(optimizers):
        opt = getattr(opt, "_optimizer", opt)
        for g, group in enumerate(opt.param_groups):
            fused, foreach = group.get("fused"), group.get("foreach")
            if fused or foreach or ("foreach" in group and foreach is None and device.type != "cpu"):
                kind = "fused" if fused else "foreach"
                raise ValueError(
                    f"dp_sharding='fsdp' with expert_parallel > 1 cannot step {type(opt).__name__} (optimizer {o}, "
                    f"param group {g}) with torch's {kind} kernels: they update a group in one call, and a stage "
                    "holds FSDP shards (DTensors) beside its expert shards (plain tensors), which those kernels "
                    f"cannot mix. Pass foreach=False{' and fused=False' if fused else ''} to {type(opt).__name__}, or "
                    "use dp_sharding='replicate'")


def check_fsdp_composition(*, precision: str) -> None:
    """What ``dp_sharding="fsdp"`` cannot run, refused at setup with the reason: a torch without the
    capability, or a precision that is not tested under it. Tied parameters, gradual pruning and
    expert parallelism compose (see the module docstring)."""
    problems = []
    missing = missing_fsdp_capability()
    if missing:
        problems.append(missing)
    if precision not in FSDP_PRECISIONS:
        problems.append(f"precision={precision!r} (supported under fsdp: {', '.join(FSDP_PRECISIONS)})")
    if problems:
        fix = ". Use dp_sharding='replicate' for this model" + (" or torch >= 2.13" if missing else "") + "."
        raise ValueError("dp_sharding='fsdp' cannot be combined with " + "; ".join(problems) + fix)
