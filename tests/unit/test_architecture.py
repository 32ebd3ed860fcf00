"""The strategy's structure rules: a strategy of Lightning's hooks and a few objects (its members
bounded, no mixin), a rebalancer and checkpoint functions that never hold or write the strategy,
and ``@override`` on every Lightning hook the strategy overrides. Import
layering, cycles and the module size alarm: ``test_layering.py``."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from lightning.pytorch.strategies import ParallelStrategy

from lightning_dynmo.strategy.strategy import DynMoStrategy

ROOT = Path(__file__).resolve().parents[2]
STRATEGY = ROOT / "lightning_dynmo" / "strategy"


def test_rebalancer_and_checkpoint_write_only_their_own_fields():
    """Every attribute assignment in rebalancer.py is on ``self`` (the rebalancer's own fields);
    checkpoint.py assigns no attribute at all."""
    for name, allowed in (("rebalancer", {"self"}), ("checkpoint", set())):
        tree = ast.parse((STRATEGY / f"{name}.py").read_text())
        stores = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)]
        roots = []
        for n in stores:
            base = n.value
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            roots.append((getattr(base, "id", ast.dump(base)), n.attr, n.lineno))
        bad = [r for r in roots if r[0] not in allowed]
        assert not bad, f"strategy/{name}.py writes fields of other objects: {bad}"


MAX_MEMBERS = 45


def strategy_members() -> dict[str, str]:
    """Every member the project's classes give ``DynMoStrategy`` (methods, properties and class
    attributes, and the instance attributes their code assigns on ``self``), with its class."""
    import inspect

    members: dict[str, str] = {}
    for cls in (c for c in DynMoStrategy.__mro__ if c.__module__.startswith("lightning_dynmo.")):
        for name in vars(cls):
            if not (name.startswith("__") and name.endswith("__")) and name != "_abc_impl":  # (ABCMeta's cache)
                members.setdefault(name, cls.__name__)
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                for e in ast.walk(target):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        members.setdefault(e.attr, cls.__name__)
    return members


def test_the_strategy_is_lightnings_hooks_and_a_few_objects():
    """Every project class the strategy inherits from is a Lightning strategy (no mixin), and the
    members they give it stay few: the pipeline's state and API live on ``strategy.pipeline``."""
    from lightning.pytorch.strategies import Strategy

    ours = [c for c in DynMoStrategy.__mro__ if c.__module__.startswith("lightning_dynmo.")]
    assert all(issubclass(c, Strategy) for c in ours), [c.__name__ for c in ours if not issubclass(c, Strategy)]
    members = strategy_members()
    assert "pipeline" in members and "partition" not in members and "rebalancer" not in members
    assert len(members) <= MAX_MEMBERS, f"{len(members)} members (at most {MAX_MEMBERS}): {sorted(members)}"


def _lightning_names() -> set[str]:
    return {name for cls in ParallelStrategy.__mro__ for name in vars(cls)} - {"__init__", "__doc__", "__module__"}


def test_every_overridden_lightning_hook_is_marked_override():
    ours = [cls for cls in DynMoStrategy.__mro__ if cls.__module__.startswith("lightning_dynmo.")]
    unmarked = []
    for cls in ours:
        for name, value in vars(cls).items():
            if name not in _lightning_names() or not callable(getattr(value, "fget", value)) and \
                    not isinstance(value, (classmethod, staticmethod)):
                continue
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if not getattr(fn, "__override__", False):
                unmarked.append(f"{cls.__name__}.{name}")
    assert not unmarked, f"Lightning hooks without @override: {unmarked}"
    assert len([n for c in ours for n in vars(c) if n in _lightning_names()]) >= 27


_PROBE = textwrap.dedent('''
    import json
    import lightning as L, torch
    from collections import deque
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_dynmo import DynMoStrategy
    from tests.support.workers.common import make_model

    strategy = DynMoStrategy(rebalance="every_n", rebalance_interval=1, plot=False)
    data = torch.randint(0, 64, (32, 17))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=8)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir={tmp!r})
    trainer.fit(make_model({{"n_layer": 3}}), loader)

    def reach(obj, path, seen, found):
        """What the rebalancer's object graph reaches: the strategy, the module or the Trainer
        (both lead to the strategy) anywhere in fields, containers, bound methods or closures."""
        if id(obj) in seen or isinstance(obj, (str, int, float, bool, type(None), torch.Tensor)):
            return
        seen.add(id(obj))
        if isinstance(obj, (DynMoStrategy, L.LightningModule, L.Trainer)):
            found.append(path + ": " + type(obj).__name__)
            return
        if isinstance(obj, dict):
            items = [(repr(k), v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            items = list(enumerate(obj))
        elif hasattr(obj, "__self__") and hasattr(obj, "__func__"):
            items = [("__self__", obj.__self__)]
        elif inspect.isfunction(obj):
            items = [(f"closure{{i}}", c.cell_contents) for i, c in enumerate(obj.__closure__ or ())]
        elif hasattr(obj, "__dict__"):
            items = list(vars(obj).items())
        else:
            items = []
        for key, value in items:
            reach(value, f"{{path}}.{{key}}", seen, found)

    import inspect
    found = []
    reach(strategy.pipeline.rebalancer, "rebalancer", set(), found)
    print(json.dumps({{"found": found, "decisions": len(strategy.pipeline.rebalance_history)}}))
''')


def test_rebalancer_holds_no_strategy_after_training(tmp_path):
    """A real (single-process) fit that decides every step; afterwards nothing the rebalancer
    holds leads back to the strategy, the module or the Trainer."""
    script = tmp_path / "probe.py"
    script.write_text(_PROBE.format(tmp=str(tmp_path)))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["decisions"] >= 2  # the decision path ran
    assert result["found"] == []

