"""generate() op by op (vramwidget/inference/generate_ops.py) against real transformers generate() calls
on the CPU: every storage an op creates is followed from allocation to free (a
TorchDispatchMode with weakref finalizers on the storages; the weights and the prompt, made
before the call, are left out), for tiny random Llama, Qwen2.5 (biases, tied head) and
Gemma 2 (eager attention with soft-capping, sliding and global layers, sandwich norms)
models, with and without the logits processors that ``min_new_tokens`` turns on.  The
stream of the estimate for the same shape, with the CPU's attention kernel
(``inference_runs(..., device="cpu")``), must allocate and free the same bytes in the same
order: every tensor of at least 1 KiB (smaller ones are bookkeeping: scalars, per-sequence
flags, int64 positions); frees between two allocations are compared as a set."""

import weakref

import pytest

from vramwidget.model.architecture import from_config
from vramwidget.inference.estimate import InferenceSetup
from vramwidget.inference.events import inference_events

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

#: the smallest tensor compared (bytes)
MIN_BYTES = 1024
B, PROMPT = 2, 48
COMMON = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=128, vocab_size=2048, max_position_embeddings=512)
FAMILIES = {
    "llama": dict(COMMON, model_type="llama", eos_token_id=2, bos_token_id=1),
    "qwen2": dict(COMMON, model_type="qwen2", tie_word_embeddings=True, eos_token_id=2, bos_token_id=1),
    "mistral": dict(COMMON, model_type="mistral", sliding_window=32, eos_token_id=2, bos_token_id=1),
    "gemma2": dict(COMMON, model_type="gemma2", sliding_window=32, query_pre_attn_scalar=128, pad_token_id=0,
                   eos_token_id=1, bos_token_id=2, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   layer_types=["sliding_attention", "full_attention"]),
}
ATTN = {"llama": "sdpa", "qwen2": "sdpa", "mistral": "sdpa", "gemma2": "eager"}


class _Storages(TorchDispatchMode):
    """("alloc" | "free", bytes) of every new storage an op returns, in order."""

    def __init__(self, known):
        super().__init__()
        self.events, self.live, self.known = [], set(), known

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key in self.live or key in self.known or st.nbytes() == 0:
                    continue
                self.live.add(key)
                self.events.append(("alloc", st.nbytes(), func.__name__))
                weakref.finalize(st, self._free, key, st.nbytes())
        return out

    def _free(self, key, nbytes):
        self.live.discard(key)
        self.events.append(("free", nbytes, ""))


def _traced(family, new, padded=False, **gen):
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in FAMILIES[family].items()})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                                          attn_implementation=ATTN[family]).eval()
    ids = torch.randint(3, cfg.vocab_size, (B, PROMPT))
    if padded:
        ids[0, :3] = 0            # pad_token_id: generate() infers a mask that masks them
    known = {p.untyped_storage().data_ptr() for p in list(model.parameters()) + list(model.buffers())}
    known.add(ids.untyped_storage().data_ptr())
    mode = _Storages(known)
    with torch.no_grad(), mode:
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, use_cache=True, **gen)
        events = list(mode.events)      # the returned sequences are still alive
    del out
    return _canonical([(k, n) for k, n, _op in events if n >= MIN_BYTES])


def _stream(family, new, **kw):
    arch = from_config(FAMILIES[family])
    s = InferenceSetup.from_kwargs(batch_size=B, prompt_len=PROMPT, context_len=PROMPT + new - 1,
                                   attn_implementation=ATTN[family], **kw)
    sizes, out, skipped = {}, [], set()
    for kind, key, nbytes, label in inference_events(arch, s, device="cpu"):
        if kind == "alloc":
            sizes[key] = int(nbytes)
            if label[0] in ("weights", "quantization constants") or key == "prompt":
                skipped.add(key)      # made before generate(), as the trace's known storages
                continue
            out.append(("alloc", int(nbytes)))
        else:
            n = sizes.pop(key)
            if key not in skipped:
                out.append(("free", n))
    return _canonical([(k, n) for k, n in out if n >= MIN_BYTES])


def _canonical(events):
    """Frees between two allocations as a sorted run: their order cannot change what the
    caching allocator does (each merges with its free neighbours; nothing is placed meanwhile)."""
    out, run = [], []
    for e in events:
        if e[0] == "free":
            run.append(e)
            continue
        out += sorted(run)
        run = []
        out.append(e)
    return out + sorted(run)


def _first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, a[max(0, i - 6):i + 6], b[max(0, i - 6):i + 6]
    return min(len(a), len(b)), a[-6:], b[-6:]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("min_new", [None, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_generate_allocates_and_frees_what_the_stream_says(family, min_new, padded):
    """The prefill, four decode steps and generate()'s return (the cache dropped), tensor by
    tensor; ``padded``:
    the prompt holds pad_token_id, so generate() infers an attention mask that masks it
    (InferenceSetup ``padding``: a (b, 1, q, kv) mask, SDPA with its additive copy and, with
    grouped KV heads, repeat_kv); Mistral's 32-token window is in reach of the 48-token prompt."""
    if min_new is not None and family in ("qwen2", "mistral") and padded:
        pytest.skip("the processors' tensors are the same for every family (covered by llama and gemma2)")
    gen = {"min_new_tokens": min_new} if min_new else {}
    real = _traced(family, 5, padded=padded, **gen)
    ours = _stream(family, 5, padding=padded, **gen)
    where = _first_difference(real, ours)
    assert real == ours, f"first difference at event {where[0]}: real {where[1]} vs stream {where[2]}"
