"""The widget's multi-GPU view: the device_map split and the per-GPU model states."""

import pytest

import vramwidget as vw
from vramwidget import gpus
from vramwidget.widget.calculator import Calculator
from vramwidget.widget.multigpu import DEVICE_MAP, device_map_setup, strategy_options


def test_device_map_entry_splits_the_layers_per_gpu():
    """strategy "device_map": the layers split as from_pretrained(device_map="auto") does, each
    GPU offering what torch can allocate on the chosen card; one row per GPU."""
    assert [DEVICE_MAP, 'device_map="auto" (layers split over the GPUs)'] in strategy_options()
    c = Calculator("llama-3.1-8b", method="qlora", gpu="RTX 4090", num_gpus=2, strategy=DEVICE_MAP)
    par = c.summary["parallel"]
    assert par["device_map"] and [st["gpu"] for st in par["stages"]] == [0, 1]
    g = gpus.get_gpu("RTX 4090")
    cap = gpus.capacity_bytes(g) - gpus.context_for(g)[0]
    assert device_map_setup(2, "RTX 4090")["max_memory"] == ((0, cap), (1, cap))
    kw = {k: v for k, v in c.setup_on(g).items() if k != "model"}
    want = vw.estimate_parallel("llama-3.1-8b", strategy="none", device_map="auto", max_memory={0: cap, 1: cap},
                                **kw)
    assert par["per_gpu_peak_gib"] == pytest.approx(want.peak_allocated_bytes / 2**30)
    assert c.disabled.get("tensor_parallel") and c.disabled.get("pipeline_parallel")


def test_zero3_model_states_are_listed_per_gpu():
    c = Calculator("llama-3.2-1b", num_gpus=8, strategy="zero3")
    names = [k for k, _ in c.summary["parallel"]["model_states"]]
    assert {"weights", "optimizer states", "fp32 master weights", "gradients"} <= set(names)
