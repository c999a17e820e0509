"""device_map="auto" (vramwidget.parallel.device_map): transformers' placement, replayed without torch,
against transformers' and accelerate's own on the meta device; then what each GPU holds."""

import pytest

import vramwidget as vw
from vramwidget import VramError
from vramwidget.parallel import device_map as D
from vramwidget.model.architecture import load
from vramwidget.plan.params import param_storage as _params
from vramwidget.training import TrainingSetup
from vramwidget.units import GIB

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

MODELS = ["llama-3.1-8b", "qwen2.5-7b", "mixtral-8x7b", "llama-3.2-3b"]   # the last with a tied head
MAX_MEMORY = [{0: "10GiB", 1: "10GiB", "cpu": "200GiB"}, {0: "40GiB", 1: "40GiB", 2: "40GiB", 3: "40GiB"}]


@pytest.fixture(scope="module")
def meta_models():
    out = {}
    for name in MODELS:
        arch = load(name)
        with torch.device("meta"):
            out[name] = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**arch.config), dtype=torch.bfloat16)
    return out


@pytest.mark.parametrize("mm", MAX_MEMORY, ids=["2x10GiB+cpu", "4x40GiB"])
@pytest.mark.parametrize("name", MODELS)
def test_placement_equals_transformers_and_accelerate(meta_models, name, mm):
    """from_pretrained(device_map="auto") runs transformers.integrations.accelerate._get_device_map
    (get_balanced_memory, then infer_auto_device_map); accelerate's own infer_auto_device_map
    with its get_balanced_memory places the same: layer for layer, both equal the replay."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map
    from transformers.integrations.accelerate import _get_device_map

    model = meta_models[name]
    arch, P = load(name), _params(load(name), TrainingSetup())
    got = D.place(arch, P, "auto", mm).device_map
    assert dict(_get_device_map(model, "auto", dict(mm), None)) == got
    # accelerate balances with the mean leaf module where transformers takes the largest
    no_split = list(model._no_split_modules)
    acc_mm = get_balanced_memory(model, max_memory=dict(mm), no_split_module_classes=no_split)
    acc = D.place(arch, P, "auto", mm, flavor="accelerate")
    assert {k: int(v) for k, v in acc.max_memory.items()} == {k: int(v) for k, v in acc_mm.items()}
    assert dict(infer_auto_device_map(model, max_memory=acc_mm, no_split_module_classes=no_split)) == acc.device_map


@pytest.mark.parametrize("strategy", ["sequential", "balanced_low_0"])
def test_other_strategies(meta_models, strategy):
    from transformers.integrations.accelerate import _get_device_map

    mm = {0: "20GiB", 1: "24GiB", 2: "24GiB"}
    for name in ("llama-3.1-8b", "mixtral-8x7b"):
        got = D.place(load(name), _params(load(name), TrainingSetup()), strategy, mm).device_map
        assert dict(_get_device_map(meta_models[name], strategy, dict(mm), None)) == got


def test_generate_per_gpu_weights_kv_and_logits():
    """Each GPU holds its layers' weights and their KV cache; the embedding's GPU the
    embeddings, the head's GPU the head and the logits.  Summed over the GPUs: the
    single-GPU run's weights and KV cache."""
    mm = {0: "10GiB", 1: "10GiB"}
    split = vw.estimate_inference("llama-3.1-8b", device_map="auto", max_memory=mm, context_len=8192, batch_size=4)
    one = vw.estimate_inference("llama-3.1-8b", context_len=8192, batch_size=4)
    pl = split.placement
    assert pl.layers == [0] * 16 + [1] * 16 and pl.embedding == 0 and pl.head == 1
    assert sum(e.kv_cache_bytes for e in split.per_device.values()) == pytest.approx(one.kv_cache_bytes)
    assert sum(e.weights_bytes for e in split.per_device.values()) == pytest.approx(one.weights_bytes)
    assert split.per_device[0].kv_cache_bytes == pytest.approx(one.kv_cache_bytes / 2)
    # placement bytes as transformers counts them: the same weights per GPU (+ the rotary buffers)
    for d, e in split.per_device.items():
        assert pl.bytes_per_device[d] == pytest.approx(e.weights_bytes, abs=1024)
    assert all(e.device_total_bytes < one.device_total_bytes for e in split.per_device.values())


def test_qlora_training_on_a_split():
    """QLoRA through device_map="auto" (naive model parallel, one GPU busy at a time): each GPU
    holds its layers' 4-bit weights and adapters, their saved activations, the head's GPU the
    logits and loss; the bitsandbytes quantizer keeps 10% of max_memory free
    (adjust_max_memory), and its 0.5 B per 4-bit weight sets the split."""
    kw = dict(method="qlora", batch_size=2, seq_len=2048, gradient_checkpointing="full")
    pe = vw.estimate_parallel("llama-3.1-8b", device_map="auto", max_memory={0: "10GiB", 1: "10GiB"}, **kw)
    one = vw.estimate("llama-3.1-8b", **kw)
    assert pe.layout["gpu_of_stage"] == [0, 1]
    first, second = pe.stages
    assert first.embedding and not first.head and second.head and not second.embedding
    w = [st.estimate.component_bytes("after_load")["weights"] for st in pe.stages]
    assert sum(w) == pytest.approx(one.component_bytes("after_load")["weights"], rel=1e-9)
    assert "logits and loss" in second.estimate.component_bytes("forward")
    assert "logits and loss" not in first.estimate.component_bytes("forward")
    assert pe.per_gpu.peak_allocated_bytes < one.peak_allocated_bytes


def test_bad_inputs_name_their_field():
    with pytest.raises(VramError) as e:
        vw.estimate_parallel("llama-3.1-8b", device_map="auto")
    assert e.value.field == "max_memory"
    with pytest.raises(VramError) as e:
        vw.estimate_parallel("llama-3.1-8b", device_map="auto", max_memory={"gpu0": "10GiB"})
    assert e.value.field == "max_memory"
    with pytest.raises(VramError) as e:
        vw.estimate_parallel("llama-3.1-8b", device_map="spread", max_memory={0: "10GiB"})
    assert e.value.field == "device_map"
    with pytest.raises(VramError) as e:
        vw.estimate_parallel("llama-3.1-8b", device_map="auto", max_memory={0: "4GiB", "cpu": "64GiB"})
    assert e.value.field == "device_map"      # offloaded layers: training through the hooks is not modelled
    with pytest.raises(VramError) as e:
        vw.estimate_parallel("llama-3.1-8b", max_memory={0: "10GiB"})
    assert e.value.field == "max_memory"
    assert D._size("10GiB") == 10 * GIB and D._size("24GB") == 24 * 10**9


def test_cli_device_map_and_zero_flags(capsys):
    """``estimate --device-map auto --max-memory ...`` prints each GPU's layers; ``infer`` the
    same split of generate(); ``--zero KEY=VALUE`` reaches the ZeRO plan."""
    import json

    from vramwidget import cli

    code = cli.main(["estimate", "llama-3.1-8b", "--method", "qlora", "--device-map", "auto", "--max-memory",
                     "0=10GiB,1=10GiB", "--batch-size", "2", "--gradient-checkpointing", "full"])
    out = capsys.readouterr().out
    assert code == 0 and "GPU 0: layers 0-" in out and "+ head" in out
    code = cli.main(["infer", "llama-3.1-8b", "--device-map", "auto", "--max-memory", "0=10GiB,1=10GiB", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and set(d["per_gpu"]) == {"0", "1"}
    code = cli.main(["estimate", "llama-3.2-1b", "--strategy", "zero3", "--num-gpus", "8", "--zero",
                     "sub_group_size=1e7", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["parallel"]["zero_config"] == {"sub_group_size": 1e7}
    code = cli.main(["estimate", "llama-3.2-1b", "--device-map", "auto"])
    assert code != 0 and "max_memory" in capsys.readouterr().err


def test_the_one_gpu_inference_estimate_points_a_split_to_the_package_function():
    """vramwidget.inference.estimate.estimate_inference is one GPU's generate(): a device_map or max_memory
    there is a VramError naming the field and the function that splits (split_inference imports
    inference, so inference cannot call it back without an import circle); before, an ImportError."""
    from vramwidget.inference.estimate import estimate_inference

    for kw in ({"device_map": "auto"}, {"max_memory": {0: "10GiB"}}):
        with pytest.raises(VramError, match="vramwidget.estimate_inference") as e:
            estimate_inference("llama-3.2-1b", **kw)
        assert e.value.field == next(iter(kw))
