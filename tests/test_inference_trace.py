"""What generate() holds beside the model's forward, traced on the CPU: every tensor a real
transformers ``generate()`` call creates is followed from allocation to free (a
TorchDispatchMode that watches each output's storage), for a tiny random Llama."""

import weakref

import pytest

import vramwidget as vw

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

B, PROMPT, NEW, V = 2, 48, 6, 32000


class _VocabRows(TorchDispatchMode):
    """Live bytes of the b x V tensors (logits, their fp32 copies, processed scores) over a run,
    and the ops that made the ones live at their peak."""

    def __init__(self):
        super().__init__()
        self.live, self.cur, self.peak, self.at_peak = {}, 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and tuple(t.shape)[-1:] == (V,) and t.numel() == B * V:
                st = t.untyped_storage()
                key = st.data_ptr()
                if key in self.live:
                    continue
                self.live[key] = (st.nbytes(), str(func.overloadpacket.__name__), str(t.dtype))
                self.cur += st.nbytes()
                weakref.finalize(st, self._free, key)
                if self.cur > self.peak:
                    self.peak, self.at_peak = self.cur, sorted(self.live.values())
        return out

    def _free(self, key):
        n = self.live.pop(key, None)
        if n:
            self.cur -= n[0]


@pytest.fixture(scope="module")
def tiny():
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    return cfg, model


def _trace(model, **kw):
    ids = torch.randint(3, V, (B, PROMPT))
    mode = _VocabRows()
    with torch.no_grad(), mode:
        model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kw)
    return mode


def test_decode_holds_the_previous_steps_scores(tiny):
    """Plain greedy generate(): at the decode peak the current step's bf16 logits, its fp32
    copy and the previous step's fp32 scores (still held by the loop) are live: the decode
    phase's 'logits' component of estimate_inference, byte for byte."""
    cfg, model = tiny
    mode = _trace(model)
    assert [(n, d) for n, _, d in mode.at_peak] == sorted([(B * V * 2, "torch.bfloat16"), (B * V * 4, "torch.float32"),
                                                          (B * V * 4, "torch.float32")])
    est = vw.estimate_inference(vw.from_config(cfg.to_dict()), batch_size=B, prompt_len=PROMPT,
                                context_len=PROMPT + NEW - 1)
    assert est.component_bytes("decode")["logits"] == mode.peak == B * V * (2 + 4 + 4)


def test_logits_processors_add_their_own_copies(tiny):
    """min_new_tokens turns on MinLength/MinNewTokens processors: scores.clone() and a
    torch.where result each, beside the above (generation_temporaries' docstring)."""
    cfg, model = tiny
    plain = _trace(model).peak
    with_min = _trace(model, min_new_tokens=NEW).peak
    assert with_min >= plain + 2 * B * V * 4
