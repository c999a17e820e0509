"""Memory snapshots: the replay written in torch.cuda.memory._snapshot()'s format (read back by
PyTorch's own torch/cuda/_memory_viz.py), and real-format snapshots broken down by category."""

import pickle

import pytest

import vramwidget as vw
from vramwidget.allocator.snapshot import CATEGORIES, category_of_frames, load_snapshot

torch_viz = pytest.importorskip("torch.cuda._memory_viz")


@pytest.fixture(scope="module")
def est():
    return vw.estimate("llama-3.2-1b", batch_size=2, seq_len=1024)


def test_snapshot_opens_in_pytorchs_visualiser(est, tmp_path):
    snap = est.to_memory_snapshot()
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snap))
    data = pickle.loads(path.read_bytes())
    # segsum re-adds every block of every segment and raises on any accounting mismatch
    summary = torch_viz.segsum(data)
    assert "total_reserved" in summary
    for html in (torch_viz.trace_plot(data), torch_viz.segment_plot(data), torch_viz.trace_plot(data, plot_segments=True)):
        assert html.startswith("\n<!DOCTYPE html>") or "<html>" in html
    assert "cudaMalloc" in torch_viz.trace(data)
    actions = {e["action"] for e in data["device_traces"][0]}
    assert {"alloc", "free_requested", "free_completed", "segment_alloc"} <= actions
    # the segments are the allocator's state at the end of the replayed run
    reserved = sum(s["total_size"] for s in data["segments"])
    res = est.replay(record=True)
    assert reserved == res.reserved_bytes
    assert sum(b["size"] for s in data["segments"] for b in s["blocks"]
               if b["state"] == "active_allocated") == res.allocated_bytes


def test_own_snapshot_reads_back_as_the_estimate(est):
    """The replay's snapshot, read by load_snapshot: its allocated peak is the estimate's
    (within the replay's 0.5%), its reserve is the predicted reserve, and the categories at
    the peak are the estimate's components at its peak phase."""
    b = load_snapshot(pickle.dumps(est.to_memory_snapshot()))
    assert b.peak_allocated_bytes == pytest.approx(est.peak_allocated_bytes, rel=0.005)
    assert b.max_reserved_bytes == est.reserved_bytes
    comps = {c.name: c.bytes for c in est.components}
    for cat in ("weights", "optimizer states", "workspace", "logits and loss"):
        assert b.at_peak[cat] == pytest.approx(comps[cat], rel=0.01), cat
    assert b.at_peak["activations"] == pytest.approx(comps["activations"], rel=0.02)
    # after the third step only weights, states and the cuBLAS workspace stay
    assert set(b.at_snapshot) == {"weights", "optimizer states", "workspace"}


def _frame(filename, name, line=1):
    return {"filename": filename, "line": line, "name": name}


#: what torch records (innermost frame first) for each kind of tensor in a transformers run
FRAMES = {
    "weights": [_frame("torch/nn/modules/module.py", "_apply"), _frame("transformers/modeling_utils.py",
                                                                        "from_pretrained")],
    "quantization constants": [_frame("bitsandbytes/functional.py", "quantize_4bit"),
                               _frame("transformers/modeling_utils.py", "from_pretrained")],
    "adapters": [_frame("peft/tuners/lora/layer.py", "update_layer"), _frame("peft/mapping.py", "get_peft_model")],
    "gradients": [_frame("torch/autograd/__init__.py", "backward"), _frame("torch/_tensor.py", "backward")],
    "optimizer states": [_frame("torch/optim/adamw.py", "_init_group"), _frame("torch/optim/optimizer.py", "wrapper")],
    "activations": [_frame("torch/nn/functional.py", "silu"),
                    _frame("transformers/models/llama/modeling_llama.py", "forward")],
    "logits and loss": [_frame("torch/nn/functional.py", "cross_entropy"),
                        _frame("transformers/loss/loss_utils.py", "ForCausalLMLoss")],
    "optimizer temporaries": [_frame("torch/optim/adamw.py", "_multi_tensor_adamw"),
                              _frame("torch/optim/optimizer.py", "wrapper")],
    "workspace": [],
}


@pytest.mark.parametrize("cat", sorted(FRAMES))
def test_frames_give_each_category(cat):
    assert category_of_frames(FRAMES[cat]) == cat


def _hand_made(expandable: bool):
    """A small real-format snapshot: one allocation of each category, a free, a peak."""
    mib = 2**20
    sizes = {cat: (i + 1) * mib for i, cat in enumerate(sorted(FRAMES))}
    trace, blocks, addr = [], [], 1 << 30
    seg_size = sum(sizes.values()) + 4 * mib
    trace.append({"action": "segment_map" if expandable else "segment_alloc", "addr": addr, "size": seg_size,
                  "stream": 0, "frames": []})
    a = addr
    for cat, size in sizes.items():
        trace.append({"action": "alloc", "addr": a, "size": size, "stream": 0, "frames": FRAMES[cat]})
        blocks.append({"address": a, "size": size, "requested_size": size, "state": "active_allocated",
                       "frames": FRAMES[cat]})
        a += size
    # the activations and the optimizer temporaries are freed after the peak
    for cat in ("activations", "optimizer temporaries"):
        start = addr + sum(sizes[c] for c in sorted(FRAMES)[:sorted(FRAMES).index(cat)])
        trace.append({"action": "free_requested", "addr": start, "size": sizes[cat], "stream": 0, "frames": []})
        trace.append({"action": "free_completed", "addr": start, "size": sizes[cat], "stream": 0, "frames": []})
        for b in blocks:
            if b["address"] == start:
                b.update(state="inactive", frames=[])
    blocks.append({"address": a, "size": 4 * mib, "requested_size": 0, "state": "inactive", "frames": []})
    seg = {"device": 0, "address": addr, "total_size": seg_size, "stream": 0, "segment_type": "large",
           "is_expandable": expandable, "blocks": blocks}
    return {"segments": [seg], "device_traces": [trace]}, sizes, seg_size


@pytest.mark.parametrize("expandable", [False, True])
def test_load_hand_made_snapshot(expandable, tmp_path):
    data, sizes, seg_size = _hand_made(expandable)
    path = tmp_path / "run.pickle"
    path.write_bytes(pickle.dumps(data))
    b = vw.load_snapshot(str(path))
    assert b.expandable_segments is expandable
    assert b.at_peak == {cat: float(v) for cat, v in sizes.items()}
    assert b.peak_allocated_bytes == sum(sizes.values())
    assert b.at_snapshot == {cat: float(v) for cat, v in sizes.items()
                             if cat not in ("activations", "optimizer temporaries")}
    assert b.reserved_bytes == b.max_reserved_bytes == seg_size
    assert b.fragmentation_bytes == seg_size - sum(b.at_snapshot.values())
    assert set(b.at_peak) <= set(CATEGORIES)
    torch_viz.segsum(data)   # the hand-made file is consistent by PyTorch's own accounting


def test_bad_snapshots_name_the_field(tmp_path):
    bad = tmp_path / "x.pickle"
    bad.write_bytes(b"not a pickle")
    for src in (str(bad), str(tmp_path / "missing.pickle"), pickle.dumps([1, 2]), {"segments": 1}):
        with pytest.raises(vw.VramError) as e:
            vw.load_snapshot(src)
        assert e.value.field == "snapshot"


# -- vramwidget measure records a snapshot (the CUDA calls, checked with a stand-in torch) -----

class _FakeCudaMemoryModule:
    def __init__(self, calls):
        self.calls = calls

    def _record_memory_history(self, enabled="all", max_entries=0, device=None, **kw):
        self.calls.append(("record", enabled, max_entries))

    def _dump_snapshot(self, path):
        self.calls.append(("dump", path))
        with open(path, "wb") as f:
            pickle.dump({"segments": [], "device_traces": [[]]}, f)


class _FakeTorch:
    def __init__(self, calls):
        cuda = type("cuda", (), {})()
        cuda.memory = _FakeCudaMemoryModule(calls)
        cuda.synchronize = lambda dev=None: None
        self.cuda = cuda


def test_measure_records_and_dumps_the_allocator_history(tmp_path):
    """CudaMemory turns torch's history recording on for the case and dumps the snapshot
    (torch.cuda.memory._record_memory_history / _dump_snapshot), then turns it off."""
    from vramwidget.measure.training import SNAPSHOT_MAX_ENTRIES, CudaMemory, NoMemory

    calls = []
    mem = CudaMemory(_FakeTorch(calls), "cuda:0")
    mem.record_history()
    path = str(tmp_path / "a01.pickle")
    assert mem.dump_snapshot(path) == path
    assert calls == [("record", "all", SNAPSHOT_MAX_ENTRIES), ("dump", path), ("record", None, 0)]
    assert vw.load_snapshot(path).segments == 0
    # the CPU path records nothing
    cpu = NoMemory()
    cpu.record_history()
    assert cpu.dump_snapshot(path) is None


def test_measure_file_names_each_cases_snapshot(tmp_path, monkeypatch):
    from vramwidget.measure import training as measure

    seen = []

    def fake(case, device="cuda", steps=3, snapshot_path=None):
        seen.append(snapshot_path)
        return {"id": case["id"], "name": case["name"], "model": case["model"], "training": case["training"],
                "measured": {"peak_allocated_mib": 1.0, "step_seconds": 0.1}, "env": {},
                "snapshot": snapshot_path and snapshot_path.rsplit("/", 1)[-1]}

    monkeypatch.setattr(measure, "measure_case", fake)
    case = measure.case_from_setup({"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 100,
                                    "n_positions": 64, "model_type": "gpt2"}, "gpt2", batch_size=1, seq_len=8)
    recs = measure.measure_file([case], str(tmp_path / "out.jsonl"), device="cpu",
                                snapshot_dir=str(tmp_path / "snaps"))
    assert seen == [str(tmp_path / "snaps" / f"{case['id']}.pickle")]
    assert recs[0]["snapshot"] == f"{case['id']}.pickle"
