"""Encoder-decoder families (T5, mT5, UMT5): ``vw.estimate`` on a config dict, the count
against transformers' T5ForConditionalGeneration built on the meta device, and the
mechanisms that differ from a decoder-only LM (loss without fp32 upcast, the encoder
output kept once by the cross-attention)."""

import json
import os

import pytest

import vramwidget as vw
from vramwidget.model.architecture import from_config

HERE = os.path.dirname(__file__)
RECORD = json.load(open(os.path.join(HERE, "data", "param_counts.json")))


def _meta_count(cfg, cls="AutoModelForSeq2SeqLM"):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    conf = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = getattr(transformers, cls).from_config(conf)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["t5-base", "flan-t5-base", "flan-t5-large", "flan-t5-xl", "t0-3b", "mt5-xl"])
def test_estimate_of_a_config_dict_counts_what_transformers_counts(name):
    from vramwidget.model.presets import get
    cfg = dict(get(name)["config"])
    est = vw.estimate(cfg, batch_size=2, seq_len=128)
    arch = from_config(cfg)
    # recorded by tools/record_param_counts.py (transformers 5.23, AutoModelForSeq2SeqLM on meta)
    assert arch.params_total == RECORD[name]["params_total"]
    assert RECORD[name]["model_class"].endswith("ForConditionalGeneration")
    df = est.to_dataframe()
    # the default bf16 setup: every weight in 2 bytes (the count above, once)
    assert df[df["component"] == "weights"]["bytes"].sum() == 2 * RECORD[name]["params_total"]
    assert any("decoder reads as many tokens" in n for n in est.notes)


def test_bart_large_counts_what_transformers_counts():
    """facebook/bart-large as BartForConditionalGeneration: 406,291,456 parameters (recorded by
    tools/record_param_counts.py with transformers 5.23 on meta; lm_head and both stacks'
    embed_tokens are ``model.shared``), and a tiny config with unequal stacks built live."""
    from vramwidget.model.presets import get
    cfg = dict(get("bart-large")["config"])
    assert from_config(cfg).params_total == RECORD["bart-large"]["params_total"] == 406_291_456
    assert RECORD["bart-large"]["model_class"] == "BartForConditionalGeneration"
    est = vw.estimate(cfg, batch_size=2, seq_len=128)
    assert est.params_total == 406_291_456
    assert any("decoder reads as many tokens" in n for n in est.notes)
    tiny = dict(model_type="bart", d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=100,
                max_position_embeddings=32)
    assert from_config(tiny).params_total == _meta_count(tiny, "AutoModelForSeq2SeqLM")


def test_live_meta_count_of_an_untied_v1_1_config():
    """A T5 v1.1 config (gated-gelu, tie_word_embeddings false) built by transformers now."""
    cfg = dict(model_type="t5", d_model=128, d_kv=32, d_ff=320, num_layers=3, num_decoder_layers=2, num_heads=4,
               vocab_size=300, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    assert from_config(cfg).params_total == _meta_count(cfg)


def test_flan_t5_xl_released_size():
    """flan-t5-xl: 2,849,757,184 parameters on the Hub (its own lm_head, 32128 x 2048);
    transformers 5 ties lm_head to ``shared``, so it counts 65,798,144 fewer."""
    arch = vw.load_architecture("flan-t5-xl")
    assert arch.params_total == 2_849_757_184 - 32128 * 2048


def test_loss_runs_on_the_16_bit_logits():
    """T5ForConditionalGeneration calls CrossEntropyLoss on lm_logits as they are: no fp32 copy
    of the logits (ForCausalLMLoss's ``logits.float()``); log_softmax in bf16."""
    est = vw.estimate("flan-t5-base", batch_size=4, seq_len=256)
    names = [r["tensor"] for r in est.to_dataframe().to_dict("records")]
    assert not any("upcast" in n for n in names)
    T, V = 4 * 256, 32128
    logits = est.to_dataframe()
    ls = logits[logits["tensor"].str.startswith("log_softmax output")]["bytes"]
    assert (ls == T * V * 2).all() and len(ls) >= 1


def test_encoder_output_kept_once_not_per_decoder_layer():
    """Every decoder layer's cross-attention k and v read the one encoder output: in full
    fine-tuning it is one T x h tensor, whatever the decoder depth."""
    cfg = dict(model_type="t5", d_model=256, d_kv=32, d_ff=512, num_heads=8, vocab_size=512,
               feed_forward_proj="gated-gelu")
    from vramwidget.plan.params import param_storage
    from vramwidget.plan.profile import activations_at
    from vramwidget.training import TrainingSetup
    s = TrainingSetup.from_kwargs(batch_size=2, seq_len=64)
    for L in (2, 6):
        arch = from_config({**cfg, "num_layers": L})
        acts = activations_at(arch, s, param_storage(arch, s))
        kept = [n for name, n, _ in acts.head if name.startswith("encoder output (kept")]
        assert kept == [2 * 64 * 256 * 2]


def test_task_encoder_has_no_decoder_layers():
    arch = vw.load_architecture("flan-t5-base", task="encoder")
    assert arch.layer_kinds == [("encoder", 12)]
    assert arch.num_layers == 12
    with pytest.raises(vw.VramError, match="task"):
        vw.estimate("flan-t5-base", task="causal_lm")


def test_t5_kv_cache_holds_self_and_cross_attention():
    """generate()'s EncoderDecoderCache: per decoder layer, self-attention k/v of the decoder
    tokens and cross-attention k/v of the encoder output (a x d_kv each per token); with the
    encoder input as long as the context that is 2 x 2 x L_dec x a x d_kv x 2 B per token."""
    from vramwidget.inference.estimate import kv_cache_bytes
    # flan-t5-xl: 24 decoder layers, 32 heads x d_kv 64
    assert kv_cache_bytes("flan-t5-xl", 512, batch_size=4) == 4 * 512 * (2 * 24) * 2 * 32 * 64 * 2
    assert kv_cache_bytes("flan-t5-xl", 512) == 2 * kv_cache_bytes("flan-t5-xl", 256)


# ----------------------------------------------------------------------------------
# Encoders: BERT (BertForMaskedLM)
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["bert-base-uncased", "bert-large-uncased"])
def test_bert_estimate_counts_bert_for_masked_lm(name):
    from vramwidget.model.presets import get
    cfg = dict(get(name)["config"])
    est = vw.estimate(cfg, batch_size=2, seq_len=128)
    # recorded with transformers 5.23 (AutoModelForMaskedLM on meta): the published 110M / 340M
    assert from_config(cfg).params_total == RECORD[name]["params_total"]
    assert RECORD[name]["model_class"] == "BertForMaskedLM"
    df = est.to_dataframe()
    assert df[df["component"] == "weights"]["bytes"].sum() == 2 * RECORD[name]["params_total"]


def test_bert_live_meta_count():
    cfg = dict(model_type="bert", hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=4,
               vocab_size=333, max_position_embeddings=70, type_vocab_size=1)
    assert from_config(cfg).params_total == _meta_count(cfg, "AutoModelForMaskedLM")


def test_bert_mlm_logits_cover_every_position_without_upcast():
    """BertForMaskedLM.forward: prediction_scores = cls(sequence_output) for all b x s
    positions; CrossEntropyLoss on them as they are (bf16 here)."""
    est = vw.estimate("bert-base-uncased", batch_size=8, seq_len=512)
    df = est.to_dataframe()
    ls = df[df["tensor"].str.startswith("log_softmax output")]["bytes"]
    assert len(ls) >= 1 and (ls == 8 * 512 * 30522 * 2).all()
    assert not df["tensor"].str.contains("upcast").any()


def test_encoder_has_no_kv_cache():
    from vramwidget.inference.estimate import kv_cache_bytes
    assert kv_cache_bytes("bert-base-uncased", 512, batch_size=4) == 0
    est = vw.estimate_inference("bert-base-uncased", batch_size=4, context_len=512)
    assert "kv cache" not in set(est.to_dataframe()["component"])


# ----------------------------------------------------------------------------------
# Encoders: ModernBERT (ModernBertForMaskedLM)
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["modernbert-base", "modernbert-large"])
def test_modernbert_estimate_counts_modernbert_for_masked_lm(name):
    from vramwidget.model.presets import get
    cfg = dict(get(name)["config"])
    est = vw.estimate(cfg, batch_size=2, seq_len=512)
    # recorded with transformers 5.23 (AutoModelForMaskedLM on meta): the published 149M / 395M
    assert from_config(cfg).params_total == RECORD[name]["params_total"]
    assert RECORD[name]["model_class"] == "ModernBertForMaskedLM"
    df = est.to_dataframe()
    assert df[df["component"] == "weights"]["bytes"].sum() == 2 * RECORD[name]["params_total"]


def test_modernbert_layers_alternate_global_and_local():
    """layer_types: every global_attn_every_n_layers-th layer (from 0) global, the others local
    with half of local_attention on each side (ModernBertConfig)."""
    arch = vw.load_architecture("modernbert-base")
    assert arch.family.local_layers(arch) == (22 - 8, 128)
    assert any("14 of 22 layers attend within a 128-token window" in n for n in arch.family.notes(arch))
    assert arch.layer_kinds == [("first (no attn_norm)", 1), ("layer", 21)]


def test_modernbert_loss_upcasts_the_logits():
    """ModernBertForMaskedLM uses self.loss_function (ForMaskedLMLoss: logits.float()); T5
    calls CrossEntropyLoss on the 16-bit logits."""
    fwd = _loss_tensors(vw.estimate("modernbert-base", batch_size=4, seq_len=1024))
    assert fwd["logits upcast to fp32"] == 4 * 1024 * 50368 * 4
    fwd_t5 = _loss_tensors(vw.estimate("flan-t5-base", batch_size=4, seq_len=1024))
    assert "logits upcast to fp32" not in fwd_t5 and fwd_t5["log_softmax output"] == 4 * 1024 * 32128 * 2


def _loss_tensors(est):
    """The output head's and the loss's tensors live at the forward phase's peak (the loss)."""
    return {n.name: n.bytes for path, n in est.tree("forward").leaves() if "logits and loss" in path}


def test_modernbert_has_no_kv_cache():
    from vramwidget.inference.estimate import kv_cache_bytes
    assert kv_cache_bytes("modernbert-base", 8192, batch_size=2) == 0


# ----------------------------------------------------------------------------------
# target_len: the decoder's own length (summarization, translation: 512 in, 128 out)
# ----------------------------------------------------------------------------------

def test_target_len_is_refused_where_there_is_no_decoder_stack():
    with pytest.raises(vw.VramError) as e:
        vw.estimate("llama-3.2-1b", target_len=128)
    assert str(e.value) == "target_len: llama-3.2-1b is decoder-only; its sequence is seq_len"
    assert e.value.field == "target_len"
    with pytest.raises(vw.VramError, match=r"^target_len: bert-base-uncased is an encoder \(no decoder\)"):
        vw.estimate("bert-base-uncased", seq_len=128, target_len=32)
    with pytest.raises(vw.VramError, match=r"^target_len: .* is an encoder \(no decoder\)"):
        vw.estimate("flan-t5-base", task="encoder", seq_len=128, target_len=32)
    with pytest.raises(vw.VramError, match="^target_len"):
        vw.estimate("t5-base", target_len=0)
    with pytest.raises(vw.VramError, match="^target_len: the traced backend"):
        vw.estimate("t5-base", target_len=64, backend="trace")


def test_target_len_none_or_equal_to_seq_len_is_todays_estimate():
    """target_len=None keeps every existing caller's estimate; target_len == seq_len is the
    same step (the five-term profile summed at t = s: equal to rounding)."""
    kw = dict(batch_size=4, seq_len=256)
    base = vw.estimate("t5-base", **kw)
    assert vw.estimate("t5-base", target_len=None, **kw).peak_allocated_bytes == base.peak_allocated_bytes
    same = vw.estimate("t5-base", target_len=256, **kw)
    assert same.peak_allocated_bytes == pytest.approx(base.peak_allocated_bytes, rel=1e-12)
    for k, v in base.phases_bytes.items():
        assert same.phases_bytes[k] == pytest.approx(v, rel=1e-12)


def test_t5_base_512_in_128_out():
    """t5-base (bf16 full fine-tuning, AdamW, batch 8, eager attention so the scores show):
    512 input and 128 target tokens.  Exact counts from T5ForConditionalGeneration's shapes:
    the logits and CrossEntropyLoss's log_softmax are b x t x V (8 x 128 x 32128 x 2 B); a decoder
    layer's cross-attention softmax is b x heads x t x s (8 x 12 x 128 x 512 x 2 B), its
    self-attention's b x heads x t x t; an encoder layer's b x heads x s x s."""
    kw = dict(batch_size=8, seq_len=512, attn_implementation="eager")
    before = vw.estimate("t5-base", **kw)
    after = vw.estimate("t5-base", target_len=128, **kw)
    from vramwidget.plan.params import param_storage
    from vramwidget.plan.profile import activations_at
    from vramwidget.training import TrainingSetup
    arch = vw.load_architecture("t5-base")
    s = TrainingSetup.from_kwargs(target_len=128, **kw)
    fwd = _loss_tensors(after)
    assert fwd["logits"] == fwd["log_softmax output"] == 8 * 128 * 32128 * 2
    import re
    per = {}
    for t in activations_at(arch, s, param_storage(arch, s)).per_layer:
        # the mixed stack's average block: "NAME (KIND, c of n layers)" weighs a kind's block by c / n
        name, kind, c, n = re.match(r"(.*) \((\w+), (\d+) of (\d+) layers\)$", t.name).groups()
        per[(name, kind)] = t.nbytes * int(n) / int(c)
    assert per[("cross-attention softmax output", "decoder")] == pytest.approx(8 * 12 * 128 * 512 * 2, rel=1e-12)
    assert per[("self-attention softmax output", "decoder")] == pytest.approx(8 * 12 * 128 * 128 * 2, rel=1e-12)
    assert per[("self-attention softmax output", "encoder")] == pytest.approx(8 * 12 * 512 * 512 * 2, rel=1e-12)
    # the 128-token target is between both stacks at 128 and both at 512
    both128 = vw.estimate("t5-base", **dict(kw, seq_len=128))
    assert both128.peak_allocated_bytes < after.peak_allocated_bytes < before.peak_allocated_bytes


def test_bart_target_len_sizes_the_decoder_and_the_loss():
    kw = dict(batch_size=4, seq_len=1024, method="lora")
    est = vw.estimate("bart-large", target_len=256, **kw)
    df = est.to_dataframe()
    ls = df[df["tensor"].str.startswith("log_softmax output")]["bytes"]
    assert len(ls) >= 1 and (ls == 4 * 256 * 50265 * 2).all()
    assert est.peak_allocated_bytes < vw.estimate("bart-large", **kw).peak_allocated_bytes


try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:
    @settings(max_examples=25, deadline=None)
    @given(b=st.integers(1, 16), sq=st.integers(1, 4096), tq=st.integers(1, 4096),
           mt=st.sampled_from(["t5", "bart"]), method=st.sampled_from(["full", "lora"]),
           attn=st.sampled_from(["sdpa", "eager"]))
    def test_the_five_term_profile_is_the_trace_at_any_size(b, sq, tq, mt, method, attn):
        """The profile traced at five (s, t) and solved for b s, b s^2, b t, b t^2, b s t gives,
        at any (b, s, t), what tracing the blocks and the head at that size gives (to float rounding:
        the mixed stack weighs each kind by its share of the layers, 2/5 and 3/5 here)."""
        from vramwidget.plan.params import param_storage
        from vramwidget.plan.profile import activations_at, trace_all
        from vramwidget.training import TrainingSetup
        cfg = (dict(model_type="t5", d_model=64, d_kv=16, d_ff=96, num_heads=4, num_layers=2, num_decoder_layers=3,
                    vocab_size=100, feed_forward_proj="gated-gelu") if mt == "t5" else
               dict(model_type="bart", d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, vocab_size=100,
                    max_position_embeddings=32))
        arch = from_config(cfg)
        s = TrainingSetup.from_kwargs(batch_size=b, seq_len=sq, target_len=tq, method=method,
                                      attn_implementation=attn)
        P = param_storage(arch, s)
        A = activations_at(arch, s, P)
        direct = trace_all(arch, s, P, False, b, sq, tq)
        assert A.per_layer_bytes == pytest.approx(direct["per"], rel=1e-9)
        assert A.first_layer_bytes == pytest.approx(direct["first"], rel=1e-9)
        assert {n: v for n, v, _ in A.head} == pytest.approx({n: v for n, v, _ in direct["head"]}, rel=1e-9)


def test_fit_map_varies_the_input_with_the_target_fixed():
    """fit_map's seq_len is the encoder's input; a given target_len is the same on every cell:
    each cell's allocated peak is the estimate at that seq_len with that target_len."""
    df = vw.fit_map("t5-base", "RTX 4090", batch_sizes=[2, 8], seq_lens=[256, 1024], target_len=64)
    for row in df.itertuples():
        est = vw.estimate("t5-base", batch_size=int(row.batch_size), seq_len=int(row.seq_len), target_len=64)
        assert row.peak_allocated_bytes == pytest.approx(est.peak_allocated_bytes, rel=1e-12)


def _raw_allocated_peak(events):
    """The event stream's allocated peak in the estimate's own (unrounded) sizes."""
    live, cur, peak = {}, 0.0, 0.0
    for kind, key, n, _label in events:
        if kind == "alloc":
            live[key] = n
            cur += n
        elif kind == "free":
            cur -= live.pop(key)
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("model", ["t5-base", "bart-large"])
def test_allocator_events_size_each_stack_by_its_own_length(model):
    """events.training_events with a target length: encoder blocks at b x s, decoder blocks
    (and their block-input gradients) at b x t with b x t x s cross-attention, the head and
    the loss at b x t.  The stream's allocated peak, before the allocator's rounding, is the
    analytic peak within 2% (measured -1.6% .. +0.3%; without target_len the same setups give
    -1.5% .. +0.5%), for a target shorter and longer than the input."""
    from vramwidget.model.architecture import load
    from vramwidget.plan import plan_events as training_events
    from vramwidget.training import TrainingSetup

    for kw in (dict(method="lora", batch_size=4, seq_len=512), dict(method="full", batch_size=2, seq_len=512),
               dict(method="lora", gradient_checkpointing="full", batch_size=2, seq_len=1024)):
        for t in (128, 2048):
            k = dict(kw, target_len=t)
            est = vw.estimate(model, **k)
            raw = _raw_allocated_peak(training_events(load(model), TrainingSetup.from_kwargs(**k)))
            assert raw == pytest.approx(est.peak_allocated_bytes, rel=0.02), (k, raw / est.peak_allocated_bytes)
    # the loss's tensors in the stream are b x t x V (T5, BART: CrossEntropyLoss on the 16-bit logits)
    s = TrainingSetup.from_kwargs(method="lora", batch_size=4, seq_len=512, target_len=128)
    arch = load(model)
    sizes = {lab: n for kind, _, n, lab in training_events(arch, s) if kind == "alloc" and isinstance(lab, str)}
    assert sizes["logits"] == 4 * 128 * arch.vocab_size * 2
    assert sizes["labels"] == 4 * 128 * 8


def test_max_seq_len_varies_the_input_with_the_target_fixed():
    """max_seq_len of an encoder-decoder is its input length: with target_len=128 fixed the
    longest input that fits is where fit.check turns (and longer than with the target growing
    with the input, as without target_len)."""
    from vramwidget.fit import solver as fit
    kw = dict(batch_size=8, target_len=128)
    L = fit.max_seq_len("t5-base", "RTX 4090", multiple_of=64, **kw)
    assert fit.check("t5-base", "RTX 4090", seq_len=L, **kw).fits
    assert not fit.check("t5-base", "RTX 4090", seq_len=L + 64, **kw).fits
    assert L > fit.max_seq_len("t5-base", "RTX 4090", multiple_of=64, batch_size=8)


def test_step_time_counts_each_stack_over_its_own_tokens():
    """The step time's forward FLOPs with target_len (timing.step_work): t5-base's encoder
    matmuls (q, k, v, o: 4 h^2, wi and wo: 2 h d_ff per layer) over b x s tokens; the
    decoder's self-attention, cross-attention q and o and MLP (6 h^2 + 2 h d_ff) over b x t,
    its cross-attention k and v (2 h^2) over the b x s encoder output; the head 2 b t V h; the
    attention cores 2 b (a d) (s^2 per encoder layer, t^2 + 2 t s per decoder layer: causal
    self-attention, full cross-attention).  t5-base: h 768, d_ff 3072, 12 + 12 layers, 12 heads
    x d_kv 64, V 32128 (its config.json)."""
    b, s, t, h, i, V, ad = 8, 512, 128, 768, 3072, 32128, 768
    mm = 2 * b * s * 12 * (4 * h * h + 2 * h * i) + 2 * b * t * 12 * (6 * h * h + 2 * h * i) \
        + 2 * b * s * 12 * (2 * h * h) + 2 * b * t * V * h
    core = 2 * b * ad * (s * s * 12 + (t * t + 2 * t * s) * 12)
    est = vw.estimate("t5-base", batch_size=b, seq_len=s, target_len=t)
    assert est.sources.work()[0].flops == mm + core
    # without target_len the step time is what it was (one length for both stacks)
    none = vw.estimate("t5-base", batch_size=b, seq_len=s)
    assert none.sources.work()[0].flops > est.sources.work()[0].flops
