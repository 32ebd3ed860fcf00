"""What users, callbacks and benchmarks call on ``DynMoStrategy`` besides Lightning's hooks: the
pipeline's geometry, the last step's measurements, and the rebalancing API (requests, and the
collective ``rebalance_to`` / ``repack_to`` / ``gather_layer_costs``). Each call hands the
rebalancer this rank's pipeline as a value (``_pipe``); a call that moves layers gets a new layout
back, which the strategy adopts (``_adopt``): only the strategy assigns its fields.
"""
from __future__ import annotations

from torch import nn

from ..plan.cost_model import LayerCosts
from ..plan.layout import PipelineLayout
from ..plan.partition import Partition
from ..plan.schedules import choose_microbatches
from ..plan.topology import Topology
from ..runtime.expert_parallel import ExpertShards, check_expert_parallel
from ..runtime.groups import PipelineGroups
from ..runtime.migration import MigrationStats
from .options import PipelineOptions
from .rebalancer import Rebalancer
from .state import RankPipeline, output_dir


class PipelineAPI:
    """Mixin of :class:`~lightning_dynmo.strategy.strategy.DynMoStrategy` (which sets these fields)."""

    options: PipelineOptions
    rebalancer: Rebalancer
    layout: PipelineLayout | None
    groups: PipelineGroups

    # ------------------------------------------------------------------ pipeline geometry and state
    schedule = property(lambda self: self.options.schedule.name)
    topology = property(lambda self: self.layout.topology if self.layout else None)
    partition = property(lambda self: self.layout.partition if self.layout else None)
    pipeline_group = property(lambda self: self.groups.pipeline, doc="This rank's pipeline group (None: the world).")
    data_parallel_group = property(lambda self: self.groups.data_parallel)
    released = property(lambda self: self.layout.released, doc="True on a rank re-packing released (no layers).")
    layers_attr = property(lambda self: self._layers_attr, doc="Attribute name of the layer list on the module.")

    @property
    def pipeline_parallel(self) -> int:
        pp = self.options.pipeline_parallel
        return self.num_nodes * self.num_processes if pp == "auto" else pp

    @property
    def layers(self) -> nn.ModuleList:
        """The module's layer list; entries this rank does not own are :class:`RemoteLayer`."""
        assert self._layers is not None, "layers are placed in setup()"
        return self._layers

    def local_layer_indices(self) -> list[int]:
        """Global indices of the layers this rank owns, in pipeline order."""
        return self.layout.local_layer_indices()

    def choose_microbatches(self, batch_size: int, pp: int | None = None) -> int:
        """Micro-batches for ``batch_size`` on ``pp`` pipeline ranks (default: now)."""
        return choose_microbatches(self.options.schedule, batch_size, pp or self.layout.pp_size,
                                   self.options.virtual_stages, self.options.microbatches)

    def _pipe(self) -> RankPipeline:
        """This rank's pipeline as one value: what the rebalancer and checkpoints may read."""
        return RankPipeline(self.lightning_module, self._layers, self._layers_attr, self.optimizers,
                            self.optimizer_layout, self.tied, self.profiler, self.engines, self.expert_parallel,
                            self.full_state_shapes, self.layout, self.groups, self.root_device, self.global_rank,
                            self.last_batch_size, self.last_microbatches, self._window.k, self.dp_sharding)

    def _world_topology(self) -> Topology:
        topo = Topology(self.num_nodes * self.num_processes, self.pipeline_parallel,
                        ranks_per_node=self.num_processes or None)
        check_expert_parallel(self.options.expert_parallel, topo.dp)
        return topo

    def expert_shards(self) -> ExpertShards | None:
        """This rank's expert-shard parameters and groups (None without expert parallelism)."""
        return self.expert_parallel.shards(self.lightning_module) if self.expert_parallel else None

    def invalidate_pipeline(self) -> None:
        """Forget built stages and shape metadata (call when layers change structure or grad-ness).
        Safe on any subset of ranks: the next training step rebuilds every rank's stages."""
        self.engines.clear()

    def last_step_events(self) -> list[dict]:
        """This rank's chunk timeline of the last step (for plots and the simulator)."""
        return self.profiler.event_dicts(self.global_rank)

    rank_busy_seconds = property(lambda self: list(self.rebalancer.rank_busy),
                                 doc="Compute seconds of each pipeline rank in the last step (slowest replica).")
    rank_wall_seconds = property(lambda self: list(self.rebalancer.rank_wall),
                                 doc="Pipeline-schedule wall seconds of each pipeline rank in the last step.")
    layer_load = property(lambda self: list(self.rebalancer.layer_load),
                          doc="Each layer's load factor in the last step (layers implementing ReportsLoad).")

    @property
    def dynmo_summary(self) -> dict:
        """Measured overhead (profiling, decisions, migrations) and step time after vs before
        each applied decision (same on every rank)."""
        return self.rebalancer.summary()

    # ------------------------------------------------------------------ rebalancing (public API)
    def request_rebalance(self, reason: str = "requested", reprofile: bool = True) -> None:
        """Ask for a rebalance (Algorithm 1): the next step is profiled per layer, then balanced.
        With ``reprofile=False`` (routing changed, not what layers compute) the next step decides
        from the last profile scaled by the layers' load factors, without profiling, when layers
        report their load (see :class:`~lightning_dynmo.protocol.ReportsLoad`). Callbacks call
        this on every rank (callbacks run everywhere); the decision to act is agreed in the
        step's collective."""
        self.rebalancer.request_rebalance(reason, reprofile)

    def request_repack(self, target: int | str = "auto") -> None:
        """Ask to pack the pipeline onto ``target`` ranks (or ``"auto"``): the next step is
        profiled and then packed, under any ``rebalance`` mode. A request made on some ranks only
        acts on all of them (agreed at the decision, see strategy/requests.py)."""
        self.rebalancer.request_repack(target)

    @property
    def rebalance_history(self) -> list[dict]:
        """Every decision so far as its JSON record (the lines of ``rebalance_history.jsonl``)."""
        return [d.to_record() for d in self.rebalancer.recorder.decisions]

    def gather_layer_costs(self) -> tuple[LayerCosts, list[dict]]:
        """Per-layer costs identical on every rank, plus every rank's last chunk timeline. Collective."""
        return self.rebalancer.gather_layer_costs(self._pipe())

    def output_dir(self) -> str | None:
        """Where logs go (``Trainer.log_dir`` is a broadcast: call on every rank)."""
        return output_dir(self.lightning_module.trainer)

    def rebalance_to(self, new: Partition | tuple[int, ...] | list[int]) -> MigrationStats:
        """Move layers (with all their state) so that ``new`` becomes the partition. Collective:
        every pipeline rank of every replica must call it with the same partition."""
        target = new if isinstance(new, Partition) else Partition(tuple(new))
        change = self.rebalancer.rebalance_to(target, self._pipe())
        self._adopt(change)
        return change.migration if change.migration is not None else MigrationStats()

    def repack_to(self, ranks: int, partition: Partition | tuple[int, ...] | list[int]) -> list[int]:
        """Move every layer (with its state) onto the first ``ranks`` pipeline ranks of each
        replica, rebuild the pipeline groups on them and release the others. Collective over the
        world: every rank calls it with the same arguments. Returns the released global ranks."""
        partition = partition if isinstance(partition, Partition) else Partition(tuple(partition))
        change, _, _ = self.rebalancer.migrate(partition, self._pipe(), ranks=ranks)
        self._adopt(change)
        return self.released_ranks

    @property
    def released_ranks(self) -> list[int]:
        """Global ranks re-packing has released so far (empty before any packing)."""
        return list(self.layout.released_ranks) if self.layout is not None else []

