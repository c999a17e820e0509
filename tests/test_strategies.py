"""The data-parallel strategies as one data file (vramwidget/data/strategies.json): what each
record says is what the estimator, the step-time model, the fit solver and the widget do, and
no module keeps its own list of strategy names (issue 22: "one source for each list that is
kept twice today: the strategy lists in timing, widget/multigpu and fit")."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import vramwidget as vw
from vramwidget.parallel import strategies
from vramwidget.parallel.strategies import BY_NAME

PKG = Path(vw.__file__).parent
NAMES = set(BY_NAME)


def _per_gpu_states(name: str, gpus: int):
    return vw.estimate_parallel("llama-3.2-1b", method="full", strategy=name, num_gpus=gpus,
                                batch_size=1, seq_len=256).model_states


@pytest.fixture(scope="module")
def halving():
    """Each strategy's per-GPU model states on 4 GPUs over those on 2 (Llama-3.2-1B full)."""
    out = {}
    for name in BY_NAME:
        if name == "none":
            continue
        two, four = _per_gpu_states(name, 2), _per_gpu_states(name, 4)
        out[name] = {k: four[k] / two[k] for k in two if two[k]}
    return out


@pytest.mark.parametrize("name", sorted(NAMES - {"none"}))
def test_partitions_are_what_the_per_gpu_estimate_divides(name, halving):
    """Doubling the GPUs halves exactly what the record says is partitioned (the optimizer
    states, the gradients, the weights) and leaves the rest whole."""
    rec, r = BY_NAME[name], halving[name]
    assert r["optimizer states"] == (0.5 if "optimizer_states" in rec.partitions else 1.0)
    assert r["weights"] == (0.5 if "parameters" in rec.partitions else 1.0)
    grads = r.get("gradients", r.get("fp32 gradients"))
    assert grads == (0.5 if "gradients" in rec.partitions else 1.0)


def test_the_step_time_model_runs_the_records_collectives():
    """timing.communication names the collectives the record says (gradient_sync,
    parameter_all_gathers, shard_group) for Llama-3.2-1B full on 16 GPUs of 8 per node."""
    seen = {}
    for name in ("ddp", "zero2", "zero3", "fsdp_shard_grad_op", "fsdp_hybrid"):
        pe = vw.estimate_parallel("llama-3.2-1b", method="full", strategy=name, num_gpus=16, gpus_per_node=8,
                                  batch_size=1, seq_len=256, gpu="H100-80GB")
        seen[name] = set(pe.slowest.time_breakdown["communication"]["collectives_seconds"])
    assert seen["ddp"] == {"gradient all-reduce"}
    assert seen["zero2"] == {"gradient reduce-scatter", "parameter all-gather after the step"}
    assert seen["zero3"] == {"parameter all-gathers (forward and backward)", "gradient reduce-scatter"}
    assert seen["fsdp_shard_grad_op"] == seen["zero3"]
    # HYBRID_SHARD shards within a node and all-reduces across the two nodes
    assert seen["fsdp_hybrid"] == seen["zero3"] | {"gradient all-reduce across nodes"}


def test_one_list_feeds_the_cli_the_widget_and_the_solver():
    from vramwidget.fit.solver import SHARDED
    from vramwidget.parallel.estimate import STRATEGIES
    from vramwidget.widget.multigpu import strategy_options

    raw = json.loads((PKG / "data" / "strategies.json").read_text())["strategies"]
    assert list(STRATEGIES) == list(raw) == list(BY_NAME)
    assert [v for v, _ in strategy_options()][:-1] == list(raw)
    assert SHARDED == ("zero2", "zero3", "fsdp_full_shard")   # the "suggest" entries by their order
    assert all(BY_NAME[n].suggest for n in SHARDED)
    # the widget greys out offload for the strategies the record says cannot do it, and
    # estimate_parallel refuses the same ones
    for name, rec in BY_NAME.items():
        if not rec.offload_params and name != "none":
            with pytest.raises(vw.VramError, match="offload_params"):
                vw.estimate_parallel("llama-3.2-1b", method="full", strategy=name, num_gpus=2,
                                     offload_params=True, batch_size=1, seq_len=64)


def test_why_no_gpu_count_fits_is_read_from_the_record():
    assert BY_NAME["ddp"].why_no_count_fits() == "every GPU keeps a whole replica"
    assert BY_NAME["zero2"].why_no_count_fits() == "shards gradients and optimizer states, not the weights"
    assert BY_NAME["fsdp_hybrid"].why_no_count_fits() == "shards only within one node"


def _lists_of_strategy_names(tree: ast.AST):
    """Tuples, lists, sets and dict keys with two or more strategy names as literals."""
    for node in ast.walk(tree):
        elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else \
            node.keys if isinstance(node, ast.Dict) else None
        if elts is None:
            continue
        # "none" is also every other choice's default (quantization, checkpointing): not counted
        hits = [e.value for e in elts if isinstance(e, ast.Constant) and e.value in NAMES - {"none"}]
        if len(hits) >= 2:
            yield node.lineno, hits


def test_no_module_keeps_its_own_list_of_strategies():
    """Outside data/strategies.json, no module lists strategy names (the readers translate
    other tools' names into ours, which is their job)."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("readers/"):
            continue
        for line, hits in _lists_of_strategy_names(ast.parse(path.read_text())):
            found.append(f"{rel}:{line} {hits}")
    assert not found, "strategy lists outside data/strategies.json:\n" + "\n".join(found)


def test_strategy_lookup_of_an_unknown_name_is_a_key_error():
    with pytest.raises(KeyError):
        strategies.strategy("zero4")
    assert strategies.names("fsdp") == ("fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid")
