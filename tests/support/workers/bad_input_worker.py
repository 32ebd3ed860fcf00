"""Failure cases that must end every rank with a clear error (never a hang).

Usage: torchrun --nproc-per-node 2 bad_input_worker.py CASES OUT
       CASES: comma-separated names from ``CASES`` below, run one after another in this one
       process group (each fails the same way on every rank, before the ranks could disagree);
       every rank writes ``{case: "ExceptionType: message"}`` to ``OUT.rank<r>.json``.
       torchrun --nproc-per-node 2 bad_input_worker.py CASE OUT, with CASE one of
       die|stall|stall_in_layer|val_raises|save_on_rank0|callback_raises:
       a rank that dies or hangs mid-training (in a callback, or in a layer on rank 1), a layer that
       raises in validation on rank 1 only, a collective call made on rank 0 only, or a callback
       that raises on rank 1 only (outside the pipeline step); the job
       must fail (these end the process group).
       Each surviving rank writes the exception it saw to ``OUT.rank<r>.txt`` the moment Lightning
       reports it (``on_exception``), before torchrun may stop it.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

import lightning as L
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelPruning, StochasticWeightAveraging

from lightning_dynmo import DynMoStrategy
from tests.support.workers.common import NoProtocol, make_loader, make_model, record_errors

CFG = {"steps": 4, "n_layer": 2}  # 5 pipeline layers: embedding, 2 blocks, final norm, head


def manual_optimisation_model():
    model = make_model(CFG)
    model.automatic_optimization = False
    return model


def parameter_outside_layers_model():
    model = make_model(CFG)
    model.temperature = nn.Parameter(torch.ones(()))  # belongs to no pipeline layer
    return model


def misbehaving_model(how: str):
    """The test GPT with its first block wrapped to break the activation protocol (``how``)."""
    from tests.support.two_stream import Misbehaving

    model = make_model(CFG)
    model.layers[1] = Misbehaving(model.layers[1], how)
    return model


class TwiceClosureSGD(torch.optim.SGD):
    """Sharpness-aware minimisation's shape: the closure at the weights, then again after a step."""

    def step(self, closure=None):
        closure()
        super().step()
        return closure()


def optimizer_model(kind: str):
    """The test GPT trained by an optimizer that evaluates the closure more than once per step."""
    model = make_model(CFG)
    make = {"lbfgs": lambda params: torch.optim.LBFGS(params, max_iter=3),
            "closure_twice": lambda params: TwiceClosureSGD(params, lr=0.1)}[kind]
    model.configure_optimizers = lambda: make(model.parameters())
    return model


def per_rank_shuffled_loader(batch: int) -> DataLoader:
    """Every rank shuffles with its own seed: the ranks of one pipeline see different batches."""
    rank = int(os.environ.get("RANK", "0"))
    data = torch.randint(0, 64, (64, 17), generator=torch.Generator().manual_seed(5))
    ds = TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())
    return DataLoader(ds, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(100 + rank))


class DiesOrStalls(L.Callback):
    def __init__(self, how: str, out: str):
        self.how, self.out = how, out

    def on_exception(self, trainer, pl_module, exception):
        with open(f"{self.out}.rank{trainer.global_rank}.txt", "w") as fh:
            fh.write(f"{type(exception).__name__}: {exception}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.how == "save_on_rank0" and batch_idx == 1 and trainer.is_global_zero:
            trainer.save_checkpoint(f"{self.out}.ckpt")  # a collective, called on one rank
        if self.how == "callback_raises" and batch_idx == 1 and trainer.global_rank == 1:
            raise RuntimeError("a user callback failed on rank 1")  # outside the pipeline step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2 and trainer.global_rank == 1 and self.how in ("die", "stall"):
            if self.how == "die":
                os._exit(3)
            # torchrun's SIGTERM (once rank 0 failed) ends it at once: Lightning's handler only records
            # the signal, so the agent would wait 30 s more for its SIGKILL; the test is about rank 0
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(600)  # a stuck rank: the others must time out


def fit(model=None, batch: int = 8, loader=None, ckpt_path=None, trainer_kw=None, callbacks=(), val_loader=None,
        **strategy_kw):
    kwargs = dict(pipeline_parallel=2, microbatches=4, timeout=8)
    kwargs.update(strategy_kw)
    trainer_kw = dict(dict(max_steps=CFG["steps"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                           enable_model_summary=False), **(trainer_kw or {}))
    trainer = L.Trainer(strategy=DynMoStrategy(**kwargs), accelerator="cpu", devices=2, callbacks=list(callbacks),
                        **trainer_kw)
    trainer.fit(model if model is not None else make_model(CFG),
                train_dataloaders=loader if loader is not None else make_loader(CFG, batch), val_dataloaders=val_loader,
                ckpt_path=ckpt_path)
    return trainer


class RaisingPredict:
    """``pipeline_predict`` fails on the last stage's rank (the only one that calls it)."""

    def pipeline_predict(self, output, batch, batch_idx):
        raise ValueError(f"no prediction for batch {batch_idx}")


def predict_raising():
    """``trainer.predict`` whose ``pipeline_predict`` raises: every rank of the pipeline raises it."""
    from lightning_dynmo.models import GPT

    model = type("RaisingGPT", (RaisingPredict, GPT), {})(**make_model(CFG).hparams)
    trainer = L.Trainer(strategy=DynMoStrategy(pipeline_parallel=2, microbatches=4, timeout=8), accelerator="cpu",
                        devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.predict(model, make_loader(CFG, 8))


class MeanStateMetric(torchmetrics.Metric):
    """A metric whose state syncs by averaging: not exact when only the last stage updates it."""

    def __init__(self):
        super().__init__()
        self.add_state("value", default=torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, output):
        self.value += output.float().mean()

    def compute(self):
        return self.value


def validate_eval_step(how: str):
    """``trainer.validate`` whose ``pipeline_eval_step`` raises, or uses a metric that cannot be
    synchronised exactly from the last stage: every rank raises the same error."""
    from lightning_dynmo.models import GPT

    class EvalStepGPT(GPT):
        def pipeline_eval_step(self, output, batch, batch_idx, stage):
            if how == "raises":
                raise ValueError(f"no metric for batch {batch_idx}")
            self.odd_metric.update(output)
            self.log("odd", self.odd_metric)

    model = EvalStepGPT(**make_model(CFG).hparams)
    model.odd_metric = (torchmetrics.MeanMetric(dist_sync_on_step=True) if how == "sync_on_step"
                        else MeanStateMetric())
    trainer = L.Trainer(strategy=DynMoStrategy(pipeline_parallel=2, microbatches=4, timeout=8), accelerator="cpu",
                        devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(model, make_loader(CFG, 8), verbose=False)


def damaged_checkpoint(out_dir: str, how: str) -> str:
    """A real checkpoint of this model (2 steps on 2 ranks), damaged by rank 0; every rank waits."""
    import torch.distributed as dist

    good = os.path.join(out_dir, "good.ckpt")
    if not os.path.exists(good):
        trainer = fit(trainer_kw={"max_steps": 2})
        trainer.save_checkpoint(good)  # collective: the pipeline gathers the full state on rank 0
    path = os.path.join(out_dir, f"{how}.ckpt")
    if dist.get_rank() == 0:
        ckpt = torch.load(good, weights_only=False)
        if how == "missing_keys":  # one entry of rank 0's first layer and one of rank 1's head
            del ckpt["state_dict"]["layers.0.wte.weight"]
            del ckpt["state_dict"]["layers.4.lm_head.weight"]
        elif how == "two_optimizers":
            ckpt["optimizer_states"] = ckpt["optimizer_states"] * 2
        torch.save(ckpt, path)
    dist.barrier()
    return path


CASES = {
    "too_many_stages": lambda out: fit(schedule="interleaved_1f1b", virtual_stages=3),  # 6 stages > 5 layers
    "batch_not_divisible": lambda out: fit(batch=6),
    "no_protocol": lambda out: fit(model=NoProtocol(4, 4)),
    "partition_does_not_fit": lambda out: fit(partition=[0, 2, 4]),  # covers 4 of the 5 layers
    "predict_hook_raises": lambda out: predict_raising(),
    "eval_hook_raises": lambda out: validate_eval_step("raises"),
    "eval_metric_mean_state": lambda out: validate_eval_step("mean_state"),
    "eval_metric_sync_on_step": lambda out: validate_eval_step("sync_on_step"),
    "manual_optimisation": lambda out: fit(model=manual_optimisation_model()),
    "parameter_outside_layers": lambda out: fit(model=parameter_outside_layers_model()),
    "different_batches": lambda out: fit(loader=per_rank_shuffled_loader(8),
                                         trainer_kw={"use_distributed_sampler": False}),
    "layer_returns_dict": lambda out: fit(model=misbehaving_model("dict")),
    "layer_returns_non_tensor": lambda out: fit(model=misbehaving_model("non_tensor")),
    "layer_changes_arity": lambda out: fit(model=misbehaving_model("arity")),
    "layer_data_dependent_shape": lambda out: fit(model=misbehaving_model("shape")),
    "checkpoint_missing_keys": lambda out: fit(ckpt_path=damaged_checkpoint(out, "missing_keys")),
    "checkpoint_two_optimizers": lambda out: fit(ckpt_path=damaged_checkpoint(out, "two_optimizers")),
    # dp_sharding="fsdp" refuses what its FSDP units cannot hold yet (one stage x two replicas)
    "fsdp_half_precision": lambda out: fit(pipeline_parallel=1, dp_sharding="fsdp",
                                           trainer_kw={"precision": "16-true"}),
    # Lightning callbacks that need the whole module in one process (unchecked, each would fail mid-step
    # on one rank while the other lost its peer, or would prune by another rule)
    "ema_callback": lambda out: fit(callbacks=[EMAWeightAveraging()]),
    "swa_callback": lambda out: fit(callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)]),
    "model_pruning_callback": lambda out: fit(callbacks=[ModelPruning("l1_unstructured", amount=0.5)]),
    # optimizers that evaluate the closure (a whole pipeline step) more than once per step
    "lbfgs": lambda out: fit(model=optimizer_model("lbfgs")),
    "closure_twice": lambda out: fit(model=optimizer_model("closure_twice")),
}


def run_cases(names: list[str], out: str) -> None:
    record_errors(lambda name: CASES[name](os.path.dirname(out)), names, out)


class OnRankOne(nn.Module):
    """``inner`` on rank 1 with a fault: it sleeps in training step 2 (``stall_in_layer``) or raises
    in validation (``val_raises``)."""

    def __init__(self, inner: nn.Module, how: str):
        super().__init__()
        self.inner, self.how = inner, how
        self.step = -1  # set by the callback below (the layer itself knows no step)
        self.eval_calls = 0

    def forward(self, x):
        if int(os.environ.get("RANK", "0")) == 1:
            if self.how == "stall_in_layer" and self.training and self.step == 2:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in DiesOrStalls.on_train_batch_start
                time.sleep(600)
            if self.how == "val_raises" and not self.training:
                self.eval_calls += 1
                if self.eval_calls > 1:  # not in the shape discovery (a problem there is every rank's error)
                    raise RuntimeError("a layer failed in validation on rank 1")
        return self.inner(x)


class StepOf(L.Callback):
    def __init__(self, layer: OnRankOne):
        self.layer = layer

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.layer.step = trainer.global_step


def main(case: str, out: str) -> None:
    if case not in ("stall_in_layer", "val_raises"):
        fit(callbacks=[DiesOrStalls(case, out)])
        return
    model = make_model(CFG)
    model.layers[-1] = layer = OnRankOne(model.layers[-1], case)  # the head: on rank 1 (the last stage)
    fit(model, rebalance="never", callbacks=[DiesOrStalls(case, out), StepOf(layer)],
        trainer_kw=dict(val_check_interval=2, limit_val_batches=1), val_loader=make_loader(CFG, 8))


if __name__ == "__main__":
    if sys.argv[1] in ("die", "stall", "stall_in_layer", "val_raises", "save_on_rank0", "callback_raises"):
        main(sys.argv[1], sys.argv[2])
    else:
        run_cases(sys.argv[1].split(","), sys.argv[2])
