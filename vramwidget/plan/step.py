"""One setup's step plan: the load, then training steps as the measurements run them.

Each step (``validation/README.md``; ``shared/tools/gpu_peak.py``): ``loss =
model(input_ids=ids, labels=ids).loss`` (forward), ``del out``, ``loss.backward()``
(backward), ``optimizer.step()`` (optimizer_step), ``optimizer.zero_grad(set_to_none=True)``
(zero_grad).  Step 1 creates the optimizer's states; steps 2 and 3 repeat themselves.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..architecture import Architecture
from ..training import TrainingSetup
from ..units import DTYPE_BYTES
from .blocks import backward_layers, forward_layers, forward_ops, layers_of, sized_ops
from .builder import PlanBuilder, StepPlan
from .context import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES, StepContext, step_context
from .load import Loaded, Trainable, load_model
from .loss import head_forward, loss_backward
from .optimizer import create_states, step_temporaries

#: steps the plan runs: the first (states made lazily) and two steady ones
STEPS = 3


def build_plan(arch: Architecture, s: TrainingSetup, b: Any = None, sq: Any = None, tq: Any = None,
               steps: int = STEPS) -> StepPlan:
    """The plan of ``s`` (at its own sizes, or at ``b``, ``sq``, ``tq``: numbers or Sizes)."""
    pb = PlanBuilder()
    cx = step_context(arch, s, pb, s.batch_size if b is None else b, s.seq_len if sq is None else sq, tq)
    for _ in range(CUBLAS_WORKSPACES):          # left from an earlier matmul of the process
        pb.alloc(CUBLAS_WORKSPACE_BYTES / CUBLAS_WORKSPACES, "cuBLAS workspace", "workspace", "cuBLAS",
                 "cuBLAS + cuBLASLt workspaces, 32 MiB each (measured, H200, PyTorch 2.11)", "uint8")
    ld = load_model(cx)
    _training_steps(cx, ld, steps)
    return pb.plan(steps)


def _embedding_side(cx: StepContext, x: Optional[int]) -> List[int]:
    """What the forward keeps from the embedding for the backward: a LoRA embedding's input
    (``profile.embed_alloc_ops``) and what the family keeps there (``Family.head_saved``:
    GPT-2's embedding dropout mask)."""
    _, kept = forward_ops(cx, sized_ops(cx, cx.prof.embed_alloc_ops), x, True, ("embedding",))
    for name, nbytes, formula in cx.arch.family.head_saved(cx.arch, cx.T, cx.s.method == "full"):
        key = cx.pb.alloc(nbytes, name, "activations", "embedding", formula, "bool")
        if key is not None:
            kept.append(key)
    return kept


def _training_steps(cx: StepContext, ld: Loaded, steps: int) -> None:
    pb, s, arch = cx.pb, cx.s, cx.arch
    lay = layers_of(cx, ld)
    pb.mark("inputs", 0)
    ids = pb.alloc(cx.T * 8, "input_ids", "activations", "inputs", "b x s x 8 B (int64)", "int64")
    # an encoder-decoder with its own target length: the labels are a tensor of their own
    labels = pb.alloc(cx.Th * 8, "labels", "activations", "inputs", "b x t x 8 B (int64)",
                      "int64") if s.target_len is not None else None
    grads: Dict[Tuple[str, int], List[Optional[int]]] = {}   # this step's gradients, per bucket
    states_made = [False]

    def grad_ready(bucket: Tuple[str, int], key: Optional[int], entry: Trainable) -> None:
        """A parameter's gradient is accumulated.  With the optimizer in backward (torchtune's
        register_optim_in_bwd_hooks, training/memory.py) its own optimizer steps in the
        post-accumulate-grad hook (making its states on the first step) and zero_grad frees
        the gradient at once; otherwise it waits for step()."""
        if not s.optimizer_in_backward:
            grads.setdefault(bucket, []).append(key)
            return
        if not states_made[0]:
            create_states(cx, [entry])
        step_temporaries(cx, [entry])
        pb.free(key)

    for step in range(1, steps + 1):
        pb.mark("forward", step)
        x = pb.alloc(cx.T * cx.h * cx.resid_bytes, "embedding output", "activations", "embedding", "T x h",
                     cx.resid)
        embed_kept = _embedding_side(cx, x)
        mask = pb.alloc(cx.b * cx.sq * cx.sq * DTYPE_BYTES[cx.c], "causal mask (eager)", "activations", "attention",
                        "b x s x s", cx.c) if cx.backend == "eager" else None
        autocast_cache: List[int] = []   # casts of trainable weights under checkpointing
        x, keep = forward_layers(cx, lay, x, autocast_cache)
        hf = head_forward(cx, lay, x)
        pb.free(mask)
        for k in autocast_cache:   # leaving torch.autocast clears its cache (autocast_mode.cpp clear_cache)
            pb.free(k)
        pb.free(hf.logits)         # del out: the logits are not saved (the head saves its input)
        pb.mark("backward", step)
        grads.clear()
        g, tied_key = loss_backward(cx, ld, hf, grad_ready)
        g = backward_layers(cx, lay, ld, keep, g, grad_ready)
        for k in embed_kept:
            pb.free(k)
        for entry in ld.embed_params:
            if arch.tie_word_embeddings and s.method == "full":
                pb.free(pb.alloc(entry[1], "embedding gradient (accumulated into the tied head's)", "gradients",
                                 "embedding", "V x h", entry[2]))
                grad_ready(("embed", 0), tied_key, entry)
                tied_key = None
            else:
                grad_ready(("embed", 0), pb.alloc(entry[1], entry[0], "gradients", entry[5], "V x h", entry[2],
                                                  label=(entry[0], "grad")), entry)
        if tied_key is not None:
            grads.setdefault(("head", 0), []).append(tied_key)
        pb.free(g)
        pb.mark("optimizer_step", step)
        if not s.optimizer_in_backward:
            if not states_made[0]:
                create_states(cx, ld.ordered)
            step_temporaries(cx, ld.ordered)
        states_made[0] = True
        pb.mark("zero_grad", step)
        for keys in grads.values():
            for k in keys:
                pb.free(k)
        pb.step_end(step)
    pb.free(ids)
    pb.free(labels)
