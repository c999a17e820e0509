"""The data-parallel strategies as data: one record per strategy, read from ``data/strategies.json``.

Every place that needs to know what a strategy does reads its :class:`Strategy` here: the
per-GPU estimate (which engine's buffers, what is partitioned), the step-time model (which
collectives, what overlaps), the fit solver (what sharding to suggest, at what traffic), the
CLI's help and the widget's drop-down and offload rules.  No module keeps its own list of
strategy names.

What the fields say, and where each comes from:

``partitions``          what is split over the shard group: ``optimizer_states`` (ZeRO-1,
                        Megatron's distributed optimizer), ``gradients`` (ZeRO-2), ``parameters``
                        (ZeRO-3, FSDP) -- Rajbhandari et al. 2020, "ZeRO", section 5; torch
                        FSDP's ShardingStrategy (torch/distributed/fsdp/api.py)
``gradient_sync``       ``all_reduce`` (DDP's buckets: torch/nn/parallel/distributed.py; ZeRO-0's
                        and Megatron's all-reduce) or ``reduce_scatter`` (ZeRO-1/2's
                        ``average_tensor``: deepspeed/runtime/zero/stage_1_and_2.py; ZeRO-3 and
                        FSDP's post-backward reduce-scatter); ``none`` without replicas
``sync_overlaps_backward``  ``always`` (DDP's bucketed all-reduce hooks; ZeRO-3 and FSDP's
                        prefetch), ``with_overlap_comm`` (DeepSpeed's ``overlap_comm`` flag, off by
                        default for ZeRO-1/2; Megatron's ``--overlap-grad-reduce``), ``never``
``parameter_all_gathers``  parameter all-gathers per pass: 2 (forward and backward: ZeRO-3,
                        FSDP FULL_SHARD and HYBRID_SHARD), 1 (SHARD_GRAD_OP keeps the forward's
                        gather to the backward), 0 (parameters kept whole)
``gathers_every_micro_batch``  the gathers repeat for each micro-batch of an accumulated step
``shard_group``         ``data_parallel`` or ``node`` (HYBRID_SHARD: sharded within a node,
                        replicated across nodes, then all-reduced across them)
``offload_optimizer`` / ``offload_params``  DeepSpeed's ``offload_optimizer`` (ZeRO-1/2/3) and
                        ``offload_param`` (ZeRO-3 only: deepspeed/runtime/zero/config.py); FSDP's
                        CPUOffload moves parameters (with their gradients and the optimizer step)
``suggest``             when the fit solver proposes this strategy: its order, the traffic
                        relative to DDP's all-reduce (ZeRO paper, section 7: ZeRO-2 1x, ZeRO-3
                        1.5x) and the texts it shows
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

_DATA = Path(__file__).resolve().parent.parent / "data" / "strategies.json"


@dataclass(frozen=True)
class Suggestion:
    """How the fit solver offers a strategy: its order among the offers, its traffic relative
    to DDP's all-reduce, and the texts it shows."""

    order: int
    traffic_vs_ddp: float
    time: str
    communication: str


@dataclass(frozen=True)
class Strategy:
    """One data-parallel strategy (``data/strategies.json``)."""

    name: str
    title: str                       # what it is, one line (help texts)
    label: str                       # the widget's drop-down
    short: str                       # the comparison table's column
    engine: str                      # none | torch | deepspeed | fsdp | megatron
    partitions: Tuple[str, ...]      # of optimizer_states, gradients, parameters
    gradient_sync: str               # none | all_reduce | reduce_scatter
    sync_overlaps_backward: str      # always | with_overlap_comm | never
    parameter_all_gathers: int       # per forward + backward
    gathers_every_micro_batch: bool
    shard_group: str                 # data_parallel | node
    offload_optimizer: bool
    offload_params: bool
    suggest: Optional[Suggestion] = None

    @property
    def replicates(self) -> bool:
        """Nothing is split over the data-parallel ranks: more of them add no memory room."""
        return not self.partitions

    @property
    def gathers_parameters(self) -> bool:
        """Parameters are sharded and all-gathered for compute (ZeRO-3, FSDP)."""
        return "parameters" in self.partitions

    def why_no_count_fits(self) -> str:
        """Why no GPU count can be enough (the fit solver found none): what it does not shard."""
        if self.replicates:
            return "every GPU keeps a whole replica"
        if not self.gathers_parameters:
            return "shards " + " and ".join(p.replace("_", " ") for p in reversed(self.partitions)) + ", not the weights"
        if self.shard_group == "node":
            return "shards only within one node"
        return "even sharded, one GPU's part and its working set do not fit"

    def overlaps(self, overlap_comm: bool) -> bool:
        """Whether the gradient synchronization hides behind the backward."""
        return self.sync_overlaps_backward == "always" or (
            self.sync_overlaps_backward == "with_overlap_comm" and bool(overlap_comm))


def _load() -> Dict[str, Strategy]:
    with open(_DATA, encoding="utf-8") as f:
        raw = json.load(f)["strategies"]
    out: Dict[str, Strategy] = {}
    for name, d in raw.items():
        sug = d.get("suggest")
        out[name] = Strategy(
            name=name, title=d["title"], label=d["label"], short=d["short"], engine=d["engine"],
            partitions=tuple(d["partitions"]), gradient_sync=d["gradient_sync"],
            sync_overlaps_backward=d["sync_overlaps_backward"], parameter_all_gathers=int(d["parameter_all_gathers"]),
            gathers_every_micro_batch=bool(d["gathers_every_micro_batch"]), shard_group=d["shard_group"],
            offload_optimizer=bool(d["offload_optimizer"]), offload_params=bool(d["offload_params"]),
            suggest=Suggestion(**sug) if sug else None)
    return out


#: every strategy by name, in the file's order (the drop-down's and the help's order)
BY_NAME: Dict[str, Strategy] = _load()


def strategy(name: str) -> Strategy:
    """The record of ``name`` (a KeyError for an unknown name: callers check the choice first)."""
    return BY_NAME[name]


def names(engine: Optional[str] = None) -> Tuple[str, ...]:
    """Every strategy's name, or those of one ``engine``."""
    return tuple(n for n, s in BY_NAME.items() if engine is None or s.engine == engine)


def suggested() -> Tuple[Strategy, ...]:
    """The strategies the fit solver offers when a replica does not fit, in its order."""
    return tuple(sorted((s for s in BY_NAME.values() if s.suggest), key=lambda s: s.suggest.order))
