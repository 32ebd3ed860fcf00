"""What the pipeline needs of the user's module, its layers and the fit's callbacks, checked at
setup on every rank before any collective: a clear refusal (or a warning for what trains but
differs from one process) instead of a failure deep inside a step on one rank."""
from __future__ import annotations

import dis
import os

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ..protocol import PipelineProtocolError, RemoteLayer, pipeline_layers_of
from ..runtime.expert_parallel import check_expert_parallel_model


def check_module(module, num_stages: int, pipeline_parallel: int, virtual: int,
                 activation_checkpointing: bool | str = False, expert_parallel: int = 1) -> None:
    """What the pipeline needs of the LightningModule, checked at setup (any
    ``accumulate_grad_batches`` works: strategy/accumulation.py)."""
    check_expert_parallel_model(module, expert_parallel)
    if activation_checkpointing is not False:
        try:
            pipeline_layers_of(module)
        except PipelineProtocolError as err:
            raise PipelineProtocolError(
                f"activation_checkpointing={activation_checkpointing!r} checkpoints each pipeline layer, so the module "
                f"must expose its layers: {err}"
            ) from None
    if not module.automatic_optimization:
        raise PipelineProtocolError(
            "DynMoStrategy runs backward inside the pipeline schedule and needs automatic optimisation; "
            "set `self.automatic_optimization = True` in your LightningModule"
        )
    layers = pipeline_layers_of(module)
    in_layers = {id(p) for p in layers.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in in_layers]
    if outside:
        raise PipelineProtocolError(
            f"{type(module).__name__} has parameters outside pipeline_layers(): {outside[:5]}; "
            "every parameter must be used by a pipeline layer (a parameter shared by several layers, like a "
            "tied embedding and LM head, is supported)"
        )
    check_stage_count(len(layers), num_stages, pipeline_parallel, virtual)


def check_stage_count(num_layers: int, num_stages: int, pipeline_parallel: int, virtual: int) -> None:
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} pipeline stages "
            f"(pipeline_parallel={pipeline_parallel} x virtual_stages={virtual}); "
            f"use at most {num_layers // virtual} pipeline ranks or a deeper model"
        )


# names a training_step may use for what the pipeline's own step already does (run the layers,
# compute pipeline_loss): such a training_step loses nothing when it is skipped
_PIPELINE_NAMES = {"pipeline_loss", "pipeline_layers", "forward", "training_step", "super", "layers",
                   "size", "shape", "view", "reshape", "flatten", "float", "long", "to", "mean", "detach", "item"}


def check_not_split(layers, rank: int) -> None:
    """A second ``fit`` on a module an earlier fit split across the pipeline is refused."""
    if any(isinstance(layer, RemoteLayer) for layer in layers):
        raise RuntimeError(
            f"rank {rank}: this module was already split across the pipeline by an earlier fit (Lightning's "
            "Tuner.lr_find runs one too); its optimizer cannot be rebuilt from the local layers alone. Build a fresh "
            "module and resume with trainer.fit(model, ckpt_path=...) (checkpoints load under any partition); after "
            "lr_find, build the fresh module with its suggestion: `lr = tuner.lr_find(model).suggestion()`."
        )


def unsupported_callback_problems(callbacks) -> list[str]:
    """Lightning callbacks that act on the whole module as if one process held it, each with why
    and what to use instead (refused at setup: each failed deep inside a step on one rank while
    the others lost their peer, or would prune by another rule than single-process training)."""
    from lightning.pytorch import callbacks as cb

    averaging = tuple(c for c in (getattr(cb, "WeightAveraging", None), cb.StochasticWeightAveraging) if c)
    problems = []
    for c in callbacks:
        name = type(c).__name__
        if isinstance(c, averaging):
            problems.append(
                f"{name}: it keeps an averaged copy of the whole module and writes it back, but under the pipeline "
                "each rank holds only its own layers and layers move between ranks (the copy's shapes stop matching). "
                "It is not supported yet: train without it (or average saved checkpoints offline)")
        elif isinstance(c, cb.ModelPruning):
            problems.append(
                f"{name}: it would prune each rank's layers by a threshold over that rank's layers only (not the "
                "model's) and renames pruned weights (weight -> weight_orig), which migrations and the optimizer "
                "layout key on. Use lightning_dynmo.callbacks.GradualPruning: global magnitude pruning across the "
                "pipeline whose masks move with their layers")
    return problems


def check_fit(module, layers, rank: int, callbacks=()) -> None:
    """At the setup of a fit: refuse a module an earlier fit split and callbacks that need the
    whole module in one process, warn about a skipped training_step."""
    check_not_split(layers, rank)
    problems = unsupported_callback_problems(callbacks)
    if problems:
        raise ValueError(f"rank {rank}: DynMoStrategy cannot train with " + "; ".join(problems) + ".")
    for message in (skipped_training_step_warning(module), batch_statistics_warning(layers)):
        if message:
            rank_zero_warn(message)


def batch_statistics_warning(layers) -> str | None:
    """The warning to give when a pipeline layer normalises by batch statistics (BatchNorm in
    training mode): under the pipeline each micro-batch is a batch of its own, so those statistics
    (and the running averages, updated once per micro-batch) differ from one process's."""
    from torch.nn.modules.batchnorm import _BatchNorm

    found = [f"layer {i} ({name or type(m).__name__}: {type(m).__name__})" for i, layer in enumerate(layers)
             for name, m in layer.named_modules() if isinstance(m, _BatchNorm) and m.training]
    if not found:
        return None
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return (f"{', '.join(found[:3])}{more} normalise by batch statistics: under DynMoStrategy each micro-batch "
            "(the batch split `microbatches` ways) is normalised by its own mean and variance, and the running "
            "statistics are updated once per micro-batch, so training differs from one process on the whole batch "
            "(as under gradient accumulation). Normalisation that does not mix samples (LayerNorm, GroupNorm, "
            "RMSNorm) trains the same either way.")


def _skipped_step_calls(module, step_name: str, hook_name: str) -> set[str] | None:
    """What ``module.<step_name>`` does beyond computing the loss (None: nothing is lost by
    skipping it, or the module defines ``hook_name``, the hook that takes its place)."""
    step = getattr(type(module), step_name, None)
    if step is None or step is getattr(L.LightningModule, step_name) or callable(getattr(module, hook_name, None)):
        return None
    calls = set()
    try:
        for ins in dis.get_instructions(step):
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL") and isinstance(ins.argval, str):
                calls.add(ins.argval)
    except TypeError:
        pass
    return calls if calls - _PIPELINE_NAMES else None  # only the loss, which the pipeline computes itself


def _noted_calls(calls: set[str]) -> str:
    hooks = ("manual_backward", "optimizers", "toggle_optimizer")
    noted = sorted(n for n in calls if n.startswith("log") or n in hooks)
    return f" (it calls {', '.join('self.' + n for n in noted)})" if noted else ""


def skipped_eval_step_warning(module, stage: str) -> str | None:
    """The warning to give when ``validation_step`` (``stage="val"``) or ``test_step`` holds
    logic the pipeline will skip (None: it does not, or the module defines ``pipeline_eval_step``)."""
    step_name = "validation_step" if stage == "val" else "test_step"
    calls = _skipped_step_calls(module, step_name, "pipeline_eval_step")
    if calls is None:
        return None
    return (
        f"{type(module).__name__}.{step_name} is not called under DynMoStrategy{_noted_calls(calls)}: the pipeline "
        f"runs pipeline_layers() and pipeline_loss() itself and logs {stage}_loss. Move metrics and other per-batch "
        "logic into `def pipeline_eval_step(self, output, batch, batch_idx, stage)`, which the strategy calls on the "
        "last stage's ranks with the last layer's output; its self.log calls and torchmetrics reach every rank "
        "(defining it also silences this warning)."
    )


def warn_skipped_eval_steps(module, stages: tuple[str, ...]) -> None:
    """At setup: one warning per evaluation step of ``stages`` whose logic the pipeline skips."""
    for stage in stages:
        message = skipped_eval_step_warning(module, stage)
        if message:
            rank_zero_warn(message)


def skipped_training_step_warning(module) -> str | None:
    """The warning to give when ``module.training_step`` holds logic the pipeline will skip
    (None: it does not define one, or it defines ``on_pipeline_train_loss``, the documented hook
    for per-step logic under the pipeline)."""
    calls = _skipped_step_calls(module, "training_step", "on_pipeline_train_loss")
    if calls is None:
        return None
    cls, what = type(module), _noted_calls(calls)
    return (
        f"{cls.__name__}.training_step is not called under DynMoStrategy{what}: the pipeline runs "
        "pipeline_layers() and pipeline_loss() itself and logs train_loss. Move per-step logic such as "
        "self.log(...) into `def on_pipeline_train_loss(self, loss, batch, batch_idx)`, which the strategy calls "
        "on every rank with the step's loss (defining it also silences this warning)."
    )


def shared_cores_message(device: torch.device, local_ranks: int, threads: int | None = None,
                         cores: int | None = None) -> str | None:
    """Why ``rank_speeds=True`` cannot measure speeds here (None: it can): CPU ranks whose threads
    outnumber the host's cores share them, so each measures its peers' load as its own speed. Once
    a move balances two such ranks, the former bottleneck competes with its peer for the CPU it had
    alone while the peer waited, and reads about half speed: a phantom straggler."""
    cores = cores if cores is not None else os.cpu_count() or 1
    threads = threads if threads is not None else torch.get_num_threads()
    if device.type != "cpu" or local_ranks * threads <= cores:
        return None
    return (f"rank_speeds=True is turned off: {local_ranks} ranks x {threads} thread(s) share {cores} CPU core(s) on "
            "this host, so each rank's busy time measures its peers' load, not its own speed (a rank would read "
            "slow as soon as a move balanced it). Give each rank its own cores (fewer ranks, or fewer threads with "
            "torch.set_num_threads / OMP_NUM_THREADS) to measure rank speeds, or pass rank_speeds='always' where "
            "their work does not hold a core (ranks waiting on a device or a service, an emulated cluster).")
