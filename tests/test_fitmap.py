"""vw.fit_map: every cell equals estimate() exactly, and its state is verdict()'s.

The grid is computed by the estimator's own operations on numpy arrays
(estimate.size_grid_totals), so equality is exact, not approximate: a formula changed in
one path and not the other fails here.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vramwidget as vw
from vramwidget.fit import verdict
from vramwidget.errors import VramError

BATCHES = [1, 2, 3, 8, 17]
SEQS = [1, 128, 1000, 4096]

SETUPS = [
    ("llama-3.1-8b", "RTX 4090", dict(method="qlora", gradient_checkpointing="full")),
    ("llama-3.2-1b", "RTX 4090", dict(method="full", precision="amp_bf16", optimizer="adamw_8bit")),
    ("gemma-2-2b", "A100 40GB", dict(attn_implementation="eager", method="lora")),       # b x a x s^2 scores
    ("qwen2.5-0.5b", "T4", dict(precision="fp32", attn_implementation="sdpa", grad_accum_steps=4)),
    ("mixtral-8x7b", "H200", dict(method="qlora", gradient_checkpointing="selective")),  # MoE
    ("gpt2", "T4", dict(method="freeze", trainable_layers=3)),
    # the loss variants and step-shaped mechanisms (Liger's power-of-two chunks, a step term
    # of the tokens, and the offloading stash, estimated cell by cell: still exact)
    ("llama-3.2-1b", "RTX 4090", dict(loss="chunked", loss_chunks=8)),
    ("llama-3.2-1b", "RTX 4090", dict(loss="liger")),
    ("llama-3.2-1b", "RTX 4090", dict(activation_offloading=True, gradient_checkpointing="full")),
    ("llama-3.2-1b", "RTX 4090", dict(optimizer_in_backward=True, compile=True, gradient_checkpointing="full")),
    # garbage collection by age frees cached blocks below the card's limit: a replay with the
    # capacity is not the unlimited one there even without a retry (caching.limit_unreached)
    ("llama-3.2-1b", "RTX 3060", dict(method="lora", allocator="garbage_collection_threshold:0.6")),
]


def _check(model, gpu, kw, batches, seqs, exact=False):
    """Every cell against estimate(): peak and state always; the device total where the map
    says it is exact (every cell with exact=True)."""
    df = vw.fit_map(model, gpu, batch_sizes=batches, seq_lens=seqs, exact=exact, **kw)
    assert list(df.columns) == ["batch_size", "seq_len", "peak_allocated_bytes", "device_total_bytes",
                                "band_bytes", "state", "reserved_exact"]
    assert len(df) == len(batches) * len(seqs)
    if exact:
        assert df["reserved_exact"].all()
    for r in df.itertuples():
        # made on the card: its device total counts the card's own CUDA context, as the map's
        est = vw.estimate(model, gpu=gpu, batch_size=int(r.batch_size), seq_len=int(r.seq_len), **kw)
        assert r.peak_allocated_bytes == est.peak_allocated_bytes, (r.batch_size, r.seq_len)
        v = verdict.verdict(est, gpu)
        assert r.state == v["state"], (r.batch_size, r.seq_len)
        if r.reserved_exact:
            assert r.device_total_bytes == est.device_total_bytes, (r.batch_size, r.seq_len)
            assert r.band_bytes == v["band_bytes"], (r.batch_size, r.seq_len)
        else:   # not replayed: the allocated peak with a carried-over fragmentation ratio >= 1
            assert r.device_total_bytes >= est.peak_allocated_bytes + est.cuda_context_bytes
    return df


@pytest.mark.parametrize("model, gpu, kw", SETUPS)
def test_every_cell_equals_estimate_exactly(model, gpu, kw):
    _check(model, gpu, kw, BATCHES, SEQS, exact=True)


@pytest.mark.parametrize("model, gpu, kw", SETUPS)
def test_default_map_states_equal_estimate(model, gpu, kw):
    _check(model, gpu, kw, BATCHES, SEQS)


def test_default_map_replays_only_near_the_line():
    """Llama 3.1 8B QLoRA + full checkpointing on an RTX 4090, 16 x 16 cells: the state of
    every cell is estimate()'s (checked above for smaller grids; here against the exact map),
    with at most a quarter of the cells replayed, the tight strip by its edges alone."""
    kw = dict(method="qlora", gradient_checkpointing="full")
    bs, ss = list(range(1, 33, 2)), [128 * k for k in range(1, 33, 2)]
    df = vw.fit_map("llama-3.1-8b", "RTX 4090", batch_sizes=bs, seq_lens=ss, **kw)
    dx = vw.fit_map("llama-3.1-8b", "RTX 4090", batch_sizes=bs, seq_lens=ss, exact=True, **kw)
    assert (df["state"] == dx["state"]).all()
    assert (df["peak_allocated_bytes"] == dx["peak_allocated_bytes"]).all()
    k = df["reserved_exact"]
    assert (df["device_total_bytes"][k] == dx["device_total_bytes"][k]).all()
    assert set(df["state"]) == {"fits", "tight", "does_not_fit"}
    assert 0 < k.sum() <= len(df) // 4
    # the strip around the line is found by the bisections, not replayed cell by cell: its
    # cells the bisections did not probe are tight by where they lie, with provisional totals
    tight = df[df["state"] == "tight"]
    assert 0 < tight["reserved_exact"].sum() < len(tight)
    assert (dx.loc[tight.index, "state"] == "tight").all()
    # the widget's tooltip says so: "about" before a provisional total, not before an exact one
    from vramwidget.show.charts import fitmap_rows

    rows = fitmap_rows(df, capacity_bytes=vw.fit.verdict.capacity_bytes(vw.gpus.get_gpu("RTX 4090")))
    for row, exact in zip(rows, df["reserved_exact"]):
        assert row["need"].startswith("about ") != bool(exact), row
        assert row["room"].startswith("about ") != bool(exact), row


@settings(max_examples=25, deadline=None)
@given(method=st.sampled_from(["full", "lora", "qlora", "freeze"]),
       precision=st.sampled_from(["bf16", "amp_bf16", "fp32", "amp_fp16"]),
       gc=st.sampled_from(["none", "selective", "full"]),
       attn=st.sampled_from(["sdpa", "eager", "flash_attention_2"]),
       b=st.integers(1, 64), s=st.integers(1, 9000))
def test_exact_for_any_setup(method, precision, gc, attn, b, s):
    if precision == "fp32" and attn == "flash_attention_2":
        return  # no fp32 flash kernel: estimate() rejects it too
    kw = dict(method=method, precision=precision, gradient_checkpointing=gc, attn_implementation=attn)
    if method == "freeze":
        kw["trainable_layers"] = 2
    _check("llama-3.2-1b", "RTX 4090", kw, [b, b + 1], [s])


def test_states_follow_the_line():
    """Memory grows with batch and sequence, so along each axis the states go fits ->
    tight -> does_not_fit and never back (Llama 3.1 8B QLoRA on 24 GB crosses the line)."""
    df = vw.fit_map("llama-3.1-8b", "RTX 4090", method="qlora", gradient_checkpointing="full")
    rank = {"fits": 0, "tight": 1, "does_not_fit": 2}
    for _, row in df.groupby("seq_len"):
        r = [rank[x] for x in row.sort_values("batch_size")["state"]]
        assert r == sorted(r)
    assert set(df["state"]) == {"fits", "tight", "does_not_fit"}


def test_defaults_and_bad_sizes():
    df = vw.fit_map("llama-3.2-1b", "H100-80GB")
    assert len(df) == 7 * 8 and df["batch_size"].min() == 1 and df["seq_len"].max() == 32768
    with pytest.raises(VramError, match="batch_sizes.*0"):
        vw.fit_map("llama-3.2-1b", "H100-80GB", batch_sizes=[0, 1])
    with pytest.raises(VramError, match="seq_lens"):
        vw.fit_map("llama-3.2-1b", "H100-80GB", seq_lens=[])
    with pytest.raises(VramError, match="H1000"):
        vw.fit_map("llama-3.2-1b", "H1000")


@settings(max_examples=10, deadline=None)
@given(model=st.sampled_from(["llama-3.2-1b", "gpt2", "qwen2.5-0.5b"]),
       gpu=st.sampled_from(["T4", "RTX 4090", "RTX 3060"]),
       method=st.sampled_from(["full", "lora", "qlora"]),
       gc=st.sampled_from(["none", "full"]),
       attn=st.sampled_from(["sdpa", "eager"]),
       bs=st.lists(st.integers(1, 48), min_size=2, max_size=6, unique=True),
       ss=st.lists(st.integers(16, 8192), min_size=2, max_size=6, unique=True))
def test_default_map_equals_the_exact_map(model, gpu, method, gc, attn, bs, ss):
    """The bisection assumes the state only grows along its chains; the exact map (every cell
    replayed) is the reference, on grids in any order."""
    kw = dict(method=method, gradient_checkpointing=gc, attn_implementation=attn)
    d = vw.fit_map(model, gpu, batch_sizes=bs, seq_lens=ss, **kw)
    x = vw.fit_map(model, gpu, batch_sizes=bs, seq_lens=ss, exact=True, **kw)
    assert (d["state"] == x["state"]).all()
    k = d["reserved_exact"]
    assert (d["device_total_bytes"][k] == x["device_total_bytes"][k]).all()
    assert (d["device_total_bytes"] > d["peak_allocated_bytes"]).all()     # reserved >= allocated, + context
