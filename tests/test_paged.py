"""Paged optimizer states (vramwidget.allocator.paged): outside PyTorch's caching allocator, not in
max_memory_allocated(), on the card when paged in."""

import pytest

import vramwidget as vw
from vramwidget.fit import verdict


KW = dict(method="full", batch_size=1, seq_len=512)


def test_paged_states_are_named_and_counted_on_the_card():
    """bitsandbytes PagedAdamW keeps exp_avg and exp_avg_sq in cudaMallocManaged memory
    (functional.get_paged).  The estimate's peak, reserve and device total hold them (the card
    holds them paged in at every step); torch's statistics do not: the estimate's
    torch_max_memory_allocated_bytes is the peak without them."""
    paged = vw.estimate("llama-3.2-1b", optimizer="paged_adamw", **KW)
    plain = vw.estimate("llama-3.2-1b", optimizer="adamw_fused", **KW)
    states = paged.component_bytes("optimizer_step")["optimizer states"]
    assert paged.paged_bytes == states > 0
    # the same states as fused AdamW's, on the card; torch's figure without them
    assert states == plain.component_bytes("optimizer_step")["optimizer states"]
    assert paged.torch_max_memory_allocated_bytes == paged.peak_allocated_bytes - states
    assert paged.torch_max_memory_reserved_bytes == paged.reserved_bytes - states
    assert plain.paged_bytes == 0 and plain.torch_max_memory_allocated_bytes == plain.peak_allocated_bytes
    assert any("unified memory" in n and "max_memory_allocated" in n for n in paged.notes)
    d = paged.to_dict()
    assert d["paged_bytes"] == int(round(states))


def test_the_verdict_counts_paged_states_on_the_card():
    """A step whose states fit only when paged out is judged with them paged in: the verdict
    measures the device total, which includes them."""
    paged = vw.estimate("llama-3.2-1b", optimizer="paged_adamw_8bit", **KW)
    v = verdict.verdict(paged, "RTX 4090")
    assert paged.paged_bytes > 0
    assert v["reserved_bytes"] == paged.reserved_bytes            # the reserve with the paged states in it
    assert v["need_bytes"] == v["reserved_bytes"] + v["context_bytes"]
    assert v["need_bytes"] - v["context_bytes"] - paged.torch_max_memory_reserved_bytes == pytest.approx(
        paged.paged_bytes)
