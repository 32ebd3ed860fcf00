"""A tied embedding and LM head on one rank under FSDP2 (runtime/fsdp_tied.py), two replicas:
the head's unit holds a mirror whose shard is the embedding's storage, its gradient joins the
embedding's, the optimizer holds the parameter once, and gathering both layers (as a migration
does) makes them one plain parameter again. Against one process training on both replicas'
batches."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_dynmo.protocol.activations import run_layers
from lightning_dynmo.runtime.fsdp import ShardedLayers, dp_mesh
from lightning_dynmo.runtime.optimizer_layout import OptimizerLayout
from lightning_dynmo.runtime.tied import TiedParameters, find_tied_parameters
from tests.support.workers.common import make_model

CFG = {"tied": True, "n_layer": 2}
HEAD = 4  # 5 pipeline layers: embedding, 2 blocks, final norm, head


def _batches(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))


def _loss(model, layers, x: torch.Tensor) -> torch.Tensor:
    return model.pipeline_loss(run_layers(layers, model.pipeline_inputs(x[:, :-1], x[:, 1:])), x[:, 1:])


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        model, ref = make_model(CFG), make_model(CFG)
        layers = model.pipeline_layers()
        tied = TiedParameters(find_tied_parameters(layers, "layers"))
        opt, ref_opt = model.configure_optimizers()["optimizer"], ref.configure_optimizers()["optimizer"]
        sharded = ShardedLayers(dp_mesh(dist.group.WORLD, torch.device("cpu")), layers, "layers", model, [opt],
                                OptimizerLayout.record(model, [opt], tied.aliases), tied)
        sharded.shard(range(len(layers)))
        emb, head = layers[0].wte.weight, layers[HEAD].lm_head.weight
        in_opt = [p for g in opt.param_groups for p in g["params"]]
        report = {"distinct": emb is not head, "same_storage": emb.to_local().data_ptr() == head.to_local().data_ptr(),
                  "in_optimizer": (sum(p is emb for p in in_opt), sum(p is head for p in in_opt)), "errors": []}
        root = sharded.wrap_stage(nn.Sequential(*layers))
        for step in range(2):
            x = _batches(step)
            _loss(model, root, x[rank::2]).backward()  # this replica's half; FSDP averages over both
            for r in range(2):
                (_loss(ref, ref.pipeline_layers(), x[r::2]) / 2).backward()
            tied.merge_local_gradients(layers)
            want = ref.pipeline_layers()[0].wte.weight
            report["errors"].append(((emb.grad.full_tensor() - want.grad).abs().max().item(), head.grad is None))
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            report["errors"].append(((head.full_tensor() - want).abs().max().item(),
                                     (emb.full_tensor() - want).abs().max().item()))
        sharded.reshard_all()
        sharded.gather(range(len(layers)), torch.device("cpu"))
        whole = layers[0].wte.weight
        in_opt = [p for g in opt.param_groups for p in g["params"]]
        err = (whole - ref.pipeline_layers()[0].wte.weight).abs().max().item()
        report["gathered"] = (whole is layers[HEAD].lm_head.weight, sum(p is whole for p in in_opt),
                              sorted(opt.state[whole]), err)
        sharded.shard(range(len(layers)))
        emb, head = layers[0].wte.weight, layers[HEAD].lm_head.weight
        report["resharded_same_storage"] = emb.to_local().data_ptr() == head.to_local().data_ptr()
        torch.save(report, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_tied_ends_on_one_rank_share_one_shard_and_train_as_one_parameter(tmp_path):
    mp.spawn(_worker, args=(f"file://{tmp_path / 'store'}", str(tmp_path / "report")), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"report.{rank}")
        assert r["distinct"] and r["same_storage"] and r["in_optimizer"] == (1, 0), r
        for grad_err, head_has_no_grad in r["errors"][0::2]:
            assert grad_err <= 1e-6 and head_has_no_grad, r["errors"]
        for head_err, emb_err in r["errors"][1::2]:
            assert head_err == emb_err and emb_err <= 1e-6, r["errors"]
        tied, in_optimizer, state_keys, err = r["gathered"]
        assert tied and in_optimizer == 1 and state_keys == ["exp_avg", "exp_avg_sq", "step"] and err <= 1e-6, r
        assert r["resharded_same_storage"], r
