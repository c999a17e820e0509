"""The generate() event stream (vramwidget/inference/events.py) against a real transformers
generate() on the CPU: every storage an op creates is followed from allocation to free (a
TorchDispatchMode and weakref finalizers, as tests/test_inference_trace.py does), for a tiny
random Llama built locally, and the order of the KV-cache and vocabulary-row allocations
and frees is compared with the stream's for the same shape."""

import weakref

import pytest

from vramwidget.model.architecture import from_config
from vramwidget.inference.estimate import InferenceSetup
from vramwidget.inference.events import inference_events

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

B, PROMPT, NEW, V = 2, 48, 6, 32000
CFG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=V, max_position_embeddings=256)
#: keys (or values) of one layer per token: kv heads 2 x head_dim 32 x 2 B, for the batch
CACHE_PER_TOKEN = B * 2 * 32 * 2


class _Storages(TorchDispatchMode):
    """("alloc" | "free", bytes) of every new storage an op returns, in order."""

    def __init__(self):
        super().__init__()
        self.events, self.seen = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key in self.seen or st.nbytes() == 0:
                    continue
                self.seen.add(key)
                self.events.append(("alloc", st.nbytes()))
                weakref.finalize(st, self._free, key, st.nbytes())
        return out

    def _free(self, key, nbytes):
        self.seen.discard(key)
        self.events.append(("free", nbytes))


@pytest.fixture(scope="module")
def traced():
    cfg = transformers.LlamaConfig(**CFG)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, V, (B, PROMPT))
    mode = _Storages()
    with torch.no_grad(), mode:
        model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    del model
    return cfg, mode.events


def _stream():
    arch = from_config(dict(CFG, model_type="llama"))
    # max_new_tokens = NEW: the prefill and NEW - 1 decode forwards; the cache ends at PROMPT + NEW - 1
    s = InferenceSetup.from_kwargs(batch_size=B, prompt_len=PROMPT, context_len=PROMPT + NEW - 1)
    sizes, out = {}, []
    for kind, key, nbytes, _label in inference_events(arch, s):
        if kind == "alloc":
            sizes[key] = int(nbytes)
            out.append(("alloc", int(nbytes)))
        else:
            out.append(("free", sizes.pop(key)))
    return out


def _decode_cache(events):
    """The decode phase's cache traffic: from the first allocation of a cache longer than the
    prompt, the allocations of caches longer than the prompt and the frees of any cache-sized
    storage of at least the prompt (torch.cat's results and the tensors they replace)."""
    sized = {CACHE_PER_TOKEN * t for t in range(PROMPT, PROMPT + NEW)}
    first = next(i for i, (k, n) in enumerate(events) if k == "alloc" and n in sized and n > CACHE_PER_TOKEN * PROMPT)
    return [(k, n // CACHE_PER_TOKEN) for k, n in events[first:]
            if n in sized and (k == "free" or n > CACHE_PER_TOKEN * PROMPT)]


def test_decode_cache_traffic_matches_generate(traced):
    """Per decode step and layer, as DynamicLayer.update does it: keys at S + 1 tokens, the
    S-token keys freed, values the same; 5 steps x 2 layers, then the cache dropped when
    generate() returns: identical in the trace and the stream."""
    _cfg, events = traced
    expected = []
    for S in range(PROMPT, PROMPT + NEW - 1):
        expected += [("alloc", S + 1), ("free", S)] * 4
    expected += [("free", PROMPT + NEW - 1)] * 4
    assert _decode_cache(events) == expected
    assert _decode_cache(_stream()) == expected


def test_vocabulary_rows_match_generate(traced):
    """The b x V tensors (the last position's bf16 logits, generate()'s fp32 copy, the previous
    step's fp32 scores): allocated and freed in the same order in the trace and the stream."""
    _cfg, events = traced
    rows = {B * V * 2, B * V * 4}
    real = [(k, n) for k, n in events if n in rows]
    ours = [(k, n) for k, n in _stream() if n in rows]
    assert ours == real


def test_generate_snapshot_opens_in_pytorchs_visualiser(tmp_path):
    """The replayed generate() call as torch.cuda.memory._snapshot() writes it: PyTorch's own
    torch/cuda/_memory_viz.py accounts every segment (segsum) and draws the trace, and the
    segments left are the replay's reserved and allocated bytes."""
    import pickle

    import vramwidget as vw

    torch_viz = pytest.importorskip("torch.cuda._memory_viz")
    est = vw.estimate_inference(from_config(dict(CFG, model_type="llama")), batch_size=B, prompt_len=PROMPT,
                                context_len=PROMPT + 40)
    path = tmp_path / "generate.pickle"
    path.write_bytes(pickle.dumps(est.to_memory_snapshot()))
    data = pickle.loads(path.read_bytes())
    assert "total_reserved" in torch_viz.segsum(data)
    assert "<html>" in torch_viz.trace_plot(data) or torch_viz.trace_plot(data).startswith("\n<!DOCTYPE html>")
    res = est.replay(record=True)
    assert sum(s["total_size"] for s in data["segments"]) == res.reserved_bytes
    labels = {e.get("frames", [{}])[0].get("name", "") for e in data["device_traces"][0] if e["action"] == "alloc"}
    assert any(x.startswith("kv cache") and x.endswith("(torch.cat)") for x in labels)
