"""Train a byte-level GPT with lightning_dynmo's pipeline-parallel strategy (a Hydra recipe).

    python recipes/train_gpt.py                      # default: small-cpu GPT, pp=2 on 2 CPU ranks
    python recipes/train_gpt.py --help               # config groups, main overrides, examples
    python recipes/train_gpt.py model=tiny trainer.max_steps=50 strategy.schedule=gpipe

Configs live in ``conf/`` (``conf/train_gpt.yaml`` plus the groups ``model/``, ``data/``,
``strategy/``, ``trainer/``). The strategy is built with ``hydra.utils.instantiate`` from
``strategy/*.yaml`` so every ``DynMoStrategy`` argument can be set from the command line.

Lightning starts ranks > 0 by re-running this script with the same overrides (its subprocess
launcher adds ``hydra.run.dir=<this run's dir>``), so every rank shares one run directory;
only global rank 0 prints the summary and writes ``summary.json``.

Under ``torchrun`` every rank runs this script itself: the run directory is then named after the
torchrun job (``outputs/train_gpt/torchrun-<run id>``), the same on every rank and across
restarts, and with ``--max-restarts N`` the recipe resumes from the run's last checkpoint
(``ckpt_path=last``), so a job whose rank was lost restarts where it stopped, also on fewer ranks.
Under ``srun`` it is named after the SLURM job (``outputs/train_gpt/slurm-<job id>``): with
``#SBATCH --signal=USR1@90`` every rank saves ``hpc_ckpt_<n>.ckpt`` there before the time limit,
the job is requeued under the same id, and the requeued job resumes from that checkpoint.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

_T0 = time.perf_counter()

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.utils import instantiate, to_absolute_path  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

import lightning_dynmo  # noqa: E402,F401  (registers strategy="dynmo" and the config dynmo_options)

LOGGER_CHOICES = ("csv", "tensorboard", "both", "none")
MODEL_KEYS = ("preset", "overrides", "lr", "min_lr", "warmup_steps", "weight_decay")
log = logging.getLogger("train_gpt")


def run_stamp() -> str:
    """The run directory's name: the torchrun job's id under torchrun (the same on every rank and
    across ``--max-restarts`` restarts); under ``srun`` the SLURM job's (every task starts the
    script itself, not in the same second, and a requeued job keeps its id, so Lightning finds
    the checkpoint its requeue signal saved there and resumes from it); else the start time
    ``<date>/<time>``."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return f"torchrun-{run_id}"
    job = slurm_job()
    if job:
        return f"slurm-{job}"
    return time.strftime("%Y-%m-%d/%H-%M-%S")


def slurm_job() -> str | None:
    """``<job id>`` (``<array job id>_<task id>`` in an array; ``-step<k>`` for a job's later
    steps) where Lightning runs as SLURM tasks (its ``SLURMEnvironment.detect()``), else None."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect() or not os.environ.get("SLURM_JOB_ID"):
        return None
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '0')}" if array else os.environ["SLURM_JOB_ID"]
    step = os.environ.get("SLURM_STEP_ID", "0")
    return f"{job}-step{step}" if step.isdigit() and 0 < int(step) < 0xFFFFFFF0 else job  # (batch/extern steps: none)


OmegaConf.register_new_resolver("run_stamp", run_stamp, replace=True)


# ---------------------------------------------------------------------------------- building
def build_model(cfg: DictConfig):
    """``GPT(config=GPTConfig.preset(name, **overrides), lr=..., ...)``; bad presets/fields raise here."""
    from lightning_dynmo.models import GPTConfig
    from lightning_dynmo.cli.hf_model import build_hf_model, is_hf

    if is_hf(cfg):  # model=hf: a Hugging Face causal LM from model.path
        return build_hf_model(cfg)
    m = cfg.model
    overrides = OmegaConf.to_container(m.get("overrides") or {}, resolve=True)
    gpt_config = GPTConfig.preset(m.preset, **overrides)
    if gpt_config.block_size < cfg.data.block_size:
        raise ValueError(
            f"model block_size={gpt_config.block_size} is smaller than data.block_size={cfg.data.block_size}; "
            "leave model.overrides.block_size at ${data.block_size} or shorten data.block_size"
        )
    if gpt_config.vocab_size < 256:
        raise ValueError(f"byte-level data needs vocab_size >= 256, got {gpt_config.vocab_size}")
    from lightning_dynmo.cli.dynamism import model_class  # the dynamism group picks the class (GPT, MoEGPT, ...)

    cls, extra = model_class(cfg)
    return cls(
        config=gpt_config.to_dict(),  # a plain dict: subclasses save it as a hyper-parameter
        lr=float(m.lr),
        min_lr=float(m.min_lr),
        warmup_steps=int(m.warmup_steps),
        weight_decay=float(m.weight_decay),
        seed=int(cfg.seed),
        **extra,
    )


def build_data(cfg: DictConfig):
    if OmegaConf.is_missing(cfg.data, "path"):
        raise ValueError("data=text needs a file or folder: add data.path=/path/to/text "
                         "(a file, or a folder of *.txt/*.md)")
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    if data_cfg.get("path") is not None:
        path = Path(to_absolute_path(str(data_cfg["path"])))
        if not path.exists():
            raise FileNotFoundError(f"data.path does not exist: {path}")
        data_cfg["path"] = str(path)
    return instantiate(data_cfg)


def build_strategy(cfg: DictConfig):
    """An instantiated strategy (``_target_``), or a Lightning strategy name (``strategy.name``)."""
    s = cfg.strategy
    if s.get("_target_"):
        return instantiate(s, _convert_="all")
    name = s.get("name")
    if not name:
        raise ValueError("strategy config needs either `_target_` (a class to build) or `name` (e.g. auto)")
    return str(name)


def check_config_keys(cfg: DictConfig) -> None:
    """Keys that would otherwise be silently ignored (``+model.n_layer=8`` instead of
    ``+model.overrides.n_layer=8``), before any rank starts."""
    import dataclasses

    from lightning_dynmo.models import GPTConfig
    from lightning_dynmo.cli.hf_model import check_hf_keys, is_hf

    main = OmegaConf.load(Path(__file__).resolve().parent.parent / "conf" / "train_gpt.yaml")
    groups = [next(iter(d)).split(" ")[-1].split("/")[0] for d in main.defaults if not isinstance(d, str)]
    for where, have, known in (("", cfg, [k for k in main if k not in ("defaults", "hydra")] + groups),
                               ("checkpoint.", cfg.get("checkpoint") or {}, list(main.checkpoint))):
        typo = sorted(set(have.keys()) - set(known))
        if typo:  # a `+key=...` Hydra accepted and nothing reads
            raise ValueError(f"unknown key(s) {[where + k for k in typo]}: nothing reads them; "
                             f"{where.rstrip('.') or 'the top level'} takes "
                             f"{', '.join(where + k for k in sorted(known))}")
    if is_hf(cfg):
        return check_hf_keys(cfg)
    unknown = sorted(k for k in cfg.model.keys() if k not in MODEL_KEYS)
    if unknown:
        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        present = set((cfg.model.get("overrides") or {}).keys())  # Hydra changes these; others need a leading +
        hint = "; ".join(f"{'' if k in present else '+'}model.overrides.{k}=..." for k in unknown if k in fields)
        raise ValueError(
            f"unknown model key(s) {unknown}: model.* takes {', '.join(MODEL_KEYS)}; GPT architecture fields go under "
            f"model.overrides" + (f" (use {hint})" if hint else f" (valid fields: {sorted(fields)})")
        )
    overrides = cfg.model.get("overrides") or {}
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    bad = sorted(k for k in overrides.keys() if k not in fields)
    if bad:
        raise ValueError(f"unknown model.overrides key(s) {bad}; valid GPTConfig fields: {sorted(fields)}")


def check_compatible(cfg: DictConfig, strategy: Any, model: Any = None, datamodule: Any = None) -> None:
    """Cheap checks that would otherwise fail (or silently do nothing) only after the ranks have started."""
    s = cfg.strategy
    if s.get("_target_"):
        mb = s.get("microbatches")
        bs = int(cfg.data.batch_size)
        if mb is not None and bs % int(mb):
            raise ValueError(
                f"data.batch_size={bs} is not divisible by strategy.microbatches={mb}; "
                f"pick a batch size that is a multiple of {mb} or change strategy.microbatches"
            )
        pp = s.get("pipeline_parallel")
        devices = cfg.trainer.get("devices")
        if isinstance(pp, int) and isinstance(devices, int):
            world = devices * int(cfg.trainer.get("num_nodes") or 1)
            if world % pp:
                raise ValueError(
                    f"trainer.devices x trainer.num_nodes = {world} processes cannot be split into "
                    f"pipelines of strategy.pipeline_parallel={pp}; use a multiple of {pp} devices"
                )
    if cfg.logger not in LOGGER_CHOICES:
        raise ValueError(f"logger must be one of {list(LOGGER_CHOICES)}, got {cfg.logger!r}")
    options = getattr(strategy, "options", None)
    if model is not None and options is not None and hasattr(model, "pipeline_layers"):
        from lightning_dynmo.strategy.setup_checks import check_stage_count

        devices = cfg.trainer.get("devices")
        pp = options.pipeline_parallel
        if pp == "auto":
            pp = devices * int(cfg.trainer.get("num_nodes") or 1) if isinstance(devices, int) else None
        if pp is not None:
            check_stage_count(len(model.pipeline_layers()), pp * options.virtual_stages, pp, options.virtual_stages)
    if datamodule is not None and hasattr(datamodule, "val_dataloader") and cfg.trainer.get("limit_val_batches") != 0:
        batches = len(datamodule.val_dataloader())
        if batches == 0:
            warnings.warn(
                f"validation has zero batches (data.batch_size={cfg.data.get('batch_size')}, "
                f"data.block_size={cfg.data.get('block_size')}, data.val_fraction={cfg.data.get('val_fraction')}): "
                "no val_loss will be reported; use more text, a larger val_fraction or a smaller batch/block size",
                UserWarning, stacklevel=2,
            )


def build_loggers(cfg: DictConfig, run_dir: Path) -> list:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers: list = []
    # fixed names/versions: every rank computes the same directories without listing the disk
    if cfg.logger in ("csv", "both"):
        loggers.append(CSVLogger(save_dir=str(run_dir), name="logs", version="csv"))
    if cfg.logger in ("tensorboard", "both"):
        loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="logs", version="tensorboard"))
    return loggers


def _float(x: Any) -> float | None:
    try:
        v = float(x.item() if hasattr(x, "item") else x)
    except (TypeError, ValueError):
        return None
    return v


class RunStats:
    """Lightning callback (built lazily so the module imports without lightning) recording step metrics."""

    @staticmethod
    def make():
        import lightning as L

        class _RunStats(L.Callback):
            def __init__(self) -> None:
                self.tokens_per_sec: list[float] = []
                self.step_times: list[float] = []
                self.tokens_per_step: list[int] = []
                self._t: float | None = None
                self.train_start: float | None = None
                self.train_end: float | None = None
                self.last_val_step: int | None = None
                self.initial_partition: str | None = None

            def on_train_start(self, trainer, pl_module) -> None:
                self.train_start = time.perf_counter()
                p = getattr(getattr(trainer.strategy, "pipeline", None), "partition", None)
                self.initial_partition = str(p) if p is not None else None

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                self._t = time.perf_counter()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                if self._t is not None:
                    self.step_times.append(time.perf_counter() - self._t)
                    x = batch[0] if isinstance(batch, (tuple, list)) else batch
                    self.tokens_per_step.append(int(x.numel()))
                tps = _float(trainer.callback_metrics.get("pipeline/tokens_per_sec"))
                if tps is not None and math.isfinite(tps):
                    self.tokens_per_sec.append(tps)

            def on_validation_end(self, trainer, pl_module) -> None:
                if not trainer.sanity_checking:
                    self.last_val_step = int(trainer.global_step)

            def on_train_end(self, trainer, pl_module) -> None:
                self.train_end = time.perf_counter()

        return _RunStats()


# ---------------------------------------------------------------------------------- summary
def _read_csv_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    import csv

    out: dict[str, list[tuple[int, float]]] = {}
    if not path.is_file():
        return out
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for k, v in row.items():
                if k in ("step", "epoch") or v in (None, ""):
                    continue
                try:
                    out.setdefault(k, []).append((step, float(v)))
                except ValueError:
                    pass
    return out


def _cfg_get(node: Any, key: str) -> Any:
    try:
        return node.get(key)
    except Exception:  # noqa: BLE001
        return None


def make_summary(cfg, trainer, strategy, stats, run_dir: Path, n_params: int, ckpt_cb, loggers) -> dict:
    cm = trainer.callback_metrics
    csv_path = run_dir / "logs" / "csv" / "metrics.csv"
    csv_metrics = _read_csv_metrics(csv_path) if cfg.logger in ("csv", "both") else {}

    def last(name: str) -> float | None:
        v = _float(cm.get(name)) if name in cm else None
        if v is None and csv_metrics.get(name):
            v = csv_metrics[name][-1][1]
        return v

    # tokens/s: the strategy's per-step log (global tokens over the step's wall time) averaged
    # over the run; without it (e.g. strategy=single) the recipe's own step timing.
    pipeline = getattr(strategy, "pipeline", None)  # DynMoStrategy's (None: another strategy)
    tps_values = stats.tokens_per_sec or [v for _, v in csv_metrics.get("pipeline/tokens_per_sec", [])]
    tps_source = "strategy pipeline/tokens_per_sec (mean over steps)"
    if not tps_values and stats.step_times:
        world_dp = max(1, trainer.world_size // max(1, getattr(pipeline, "pipeline_parallel", 1)))
        tps_values = [n * world_dp / t for n, t in zip(stats.tokens_per_step[1:], stats.step_times[1:]) if t > 0]
        tps_source = "recipe step timing (mean over steps, first step excluded)"
    tps_mean = sum(tps_values) / len(tps_values) if tps_values else None

    partition = getattr(pipeline, "partition", None)
    history = getattr(pipeline, "rebalance_history", None)
    rebalance_file = None
    if history:
        log_dir = Path(trainer.log_dir or run_dir) if loggers else run_dir
        candidate = log_dir / "rebalance_history.jsonl"
        rebalance_file = str(candidate) if candidate.is_file() else None
    train_s = (stats.train_end - stats.train_start) if stats.train_start and stats.train_end else None
    dynmo = getattr(pipeline, "dynmo_summary", None)  # measured overhead and gains (None: not DynMo)
    summary = {
        "model": cfg.model.get("preset") or f"hf:{Path(str(cfg.model.path)).name}",
        "parameters": n_params,
        "strategy": type(strategy).__name__ if not isinstance(strategy, str) else strategy,
        "pipeline_parallel": getattr(pipeline, "pipeline_parallel", 1),
        "schedule": getattr(pipeline, "schedule", None),
        "dp_sharding": _cfg_get(cfg.strategy, "dp_sharding"),
        "world_size": trainer.world_size,
        "partition": str(partition) if partition is not None else None,
        "partition_boundaries": list(partition.boundaries) if hasattr(partition, "boundaries") else None,
        "initial_partition": stats.initial_partition,
        "rebalance": _cfg_get(cfg.strategy, "rebalance"),
        "rebalance_decisions": sum(r.get("kind") != "skip" for r in history) if history is not None else None,
        "rebalances_applied": sum(bool(r.get("applied")) for r in history) if history is not None else None,
        "rebalance_history": rebalance_file,
        # did DynMo pay on this model: its measured overhead (profiling, decisions, migrations) and
        # the step time after vs before each applied decision
        "dynmo_overhead_fraction": dynmo.get("overhead_fraction") if dynmo else None,
        "dynmo": dynmo,
        "steps": int(trainer.global_step),
        "train_loss": last("train_loss"),
        "val_loss": last("val_loss"),
        "val_ppl": last("val_ppl"),
        "val_acc": last("val_acc"),  # next-token accuracy (the model's pipeline_eval_step)
        "val_step": stats.last_val_step,
        "tokens_per_sec_mean": tps_mean,
        "tokens_per_sec_source": tps_source,
        "train_time_s": train_s,
        "wall_time_s": time.perf_counter() - _T0,
        "run_dir": str(run_dir),
        "csv_metrics": str(csv_path) if cfg.logger in ("csv", "both") else None,
        "tensorboard_dir": next((lg.log_dir for lg in loggers if type(lg).__name__ == "TensorBoardLogger"), None),
        "checkpoint_dir": ckpt_cb.dirpath if ckpt_cb is not None else None,
        "last_checkpoint": (ckpt_cb.last_model_path or ckpt_cb.best_model_path or None)
        if ckpt_cb is not None else None,
    }
    return summary


def print_summary(s: dict) -> None:
    print(summary_text(s), flush=True)


def summary_text(s: dict) -> str:
    """The end-of-run report of a ``summary.json`` dict (the README's sample is made by this)."""
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lines = [
        "",
        "=" * 72,
        f"train_gpt summary: {s['model']} ({s['parameters'] / 1e6:.2f}M params), {s['steps']} steps, "
        f"{s['strategy']} pp={s['pipeline_parallel']} world={s['world_size']}"
        + (f" schedule={s['schedule']}" if s["schedule"] else ""),
        f"  train_loss {f(s['train_loss'], '.4f')} | val_loss {f(s['val_loss'], '.4f')} | "
        f"val_ppl {f(s['val_ppl'], '.2f')}"
        + (f" | val_acc {s['val_acc']:.3f}" if s.get("val_acc") is not None else "")
        + (f" (validated at step {s['val_step']})" if s["val_step"] is not None else ""),
        f"  tokens/s (mean) {f(s['tokens_per_sec_mean'], ',.0f')} | train {f(s['train_time_s'], '.1f')} s | "
        f"wall {s['wall_time_s']:.1f} s",
        f"  partition {s['partition'] or 'n/a (no pipeline)'}"
        + (
            f" (initial {s['initial_partition']}; rebalance={s['rebalance']}: "
            f"{s['rebalances_applied']} applied of {s['rebalance_decisions']} decisions)"
            if s["rebalance_decisions"]
            else ""
        ),
        f"  run dir      {s['run_dir']}",
    ]
    if s["csv_metrics"]:
        lines.append(f"  csv metrics  {s['csv_metrics']}")
    if s["tensorboard_dir"]:
        lines.append(f"  tensorboard  {s['tensorboard_dir']}")
    if s["rebalance_history"]:
        lines.append(f"  rebalances   {s['rebalance_history']}")
    if s.get("dynmo") and s["rebalance"] != "never":
        d = s["dynmo"]
        gains = [f"{-p['gain']:+.1%}" for p in d.get("applied_decisions", []) if p.get("gain") is not None]
        lines.append(f"  dynmo cost   {d['overhead_s'] * 1e3:.0f} ms overhead ({f(d['overhead_fraction'], '.2%')} of "
                     f"pipeline steps) + {d['migration_s'] * 1e3:.0f} ms migrations; step time after each applied "
                     f"decision: {', '.join(gains) or 'none measured'}")
    if s["checkpoint_dir"]:
        lines.append(f"  checkpoints  {s['checkpoint_dir']} (last: {s['last_checkpoint'] or 'none'})")
    lines.append(f"  summary      {Path(s['run_dir']) / 'summary.json'}")
    lines.append("=" * 72)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main
def _quiet_known_noise() -> None:
    """Drop warnings that say nothing about this recipe, and Lightning's second console handler."""
    # num_workers=0 is deliberate on small CPU boxes
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # the strategy logs val/test loss already all-reduced across ranks, so sync_dist is not needed
    warnings.filterwarnings("ignore", message=r".*self.log\('(val|test)_loss', \.\.\., sync_dist=True\).*")
    # torch/lightning version skew inside Lightning itself
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    # Hydra already logs to the console (and to <run dir>/<job>.log) from the root logger; Lightning's
    # own console handler would print every message twice.
    if logging.getLogger().handlers:
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            lg = logging.getLogger(name)
            for h in list(lg.handlers):
                if type(h) is logging.StreamHandler:
                    lg.removeHandler(h)
            lg.propagate = True


def train(cfg: DictConfig) -> dict | None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    if cfg.threads_per_rank is not None:
        n = int(cfg.threads_per_rank)
        if n < 1:
            raise ValueError(f"threads_per_rank must be >= 1 or null, got {n}")
        torch.set_num_threads(n)
        os.environ["OMP_NUM_THREADS"] = str(n)  # stops Lightning resetting it; inherited by ranks > 0

    _quiet_known_noise()

    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()

    # everything that can fail on bad config, before any process is launched
    check_config_keys(cfg)
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    datamodule = build_data(cfg)
    strategy = build_strategy(cfg)
    check_compatible(cfg, strategy, model, datamodule)
    ckpt_path = cfg.ckpt_path
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if ckpt_path is None and restarts > 0 and cfg.checkpoint.enabled:
        # torchrun --max-restarts: a restarted job resumes from the run's last checkpoint
        # (none yet on the first attempt: Lightning then starts from scratch)
        log.info("torchrun --max-restarts %d: resuming from the last checkpoint if there is one", restarts)
        ckpt_path = "last"
    if ckpt_path is not None and ckpt_path not in ("last", "best", "hpc", "registry"):
        ckpt_path = to_absolute_path(str(ckpt_path))
        if not Path(ckpt_path).is_file():
            raise FileNotFoundError(f"ckpt_path does not exist: {ckpt_path}")

    L.seed_everything(int(cfg.seed), workers=True, verbose=False)

    loggers = build_loggers(cfg, run_dir)
    stats = RunStats.make()
    callbacks: list = [stats]
    from lightning_dynmo.cli.dynamism import build_callbacks
    from lightning_dynmo.cli.multirun import prepare_multirun_children

    callbacks += build_callbacks(cfg)  # the dynamism group's callbacks (conf/dynamism/)
    prepare_multirun_children()  # under -m, ranks > 0 run this job's overrides only
    ckpt_cb = None
    if cfg.checkpoint.enabled:
        ckpt_cb = ModelCheckpoint(
            dirpath=str(run_dir / "checkpoints"),
            filename="step{step:06d}",
            auto_insert_metric_name=False,
            every_n_train_steps=int(cfg.checkpoint.every_n_train_steps),
            save_last=bool(cfg.checkpoint.save_last),
            save_top_k=int(cfg.checkpoint.save_top_k),
        )
        callbacks.append(ckpt_cb)
    if loggers:
        callbacks.append(LearningRateMonitor(logging_interval="step"))

    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    max_steps, vci = trainer_kwargs.get("max_steps"), trainer_kwargs.get("val_check_interval")
    if isinstance(max_steps, int) and max_steps > 0 and isinstance(vci, int) and vci > max_steps:
        # short runs (smoke tests) still validate once, at the end, so the summary has val_loss
        log.info("val_check_interval=%d > max_steps=%d: validating at step %d", vci, max_steps, max_steps)
        trainer_kwargs["val_check_interval"] = max_steps
    trainer = L.Trainer(
        **trainer_kwargs,
        strategy=strategy,
        logger=loggers if loggers else False,
        callbacks=callbacks,
        default_root_dir=str(run_dir),
        enable_checkpointing=ckpt_cb is not None,
    )
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)

    if not cfg.summary:
        return None
    summary = make_summary(cfg, trainer, trainer.strategy, stats, run_dir, n_params, ckpt_cb, loggers)
    if trainer.is_global_zero:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print_summary(summary)
    return summary


@hydra.main(config_path="../conf", config_name="train_gpt", version_base="1.3")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
