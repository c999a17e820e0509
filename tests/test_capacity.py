"""Usable capacity per GPU (issue 13, item 2): what torch can allocate on each catalog card,
the device memory a process sees less the CUDA context, with the source of every figure
(vramwidget/data/gpus.json), and the verdict that uses it."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vramwidget as vw
from vramwidget import gpus
from vramwidget.fit import verdict
from vramwidget.units import GIB, MIB


def test_every_catalog_gpu_has_a_usable_capacity_with_its_source():
    for g in gpus.list_gpus():
        cap, text = gpus.usable_capacity(g)
        ctx, ctx_src = gpus.context_bytes(g)
        assert 0 < ctx < 1.5 * GIB, g.name
        assert cap == pytest.approx(g.cuda_total_bytes - ctx), g.name
        # below nvidia-smi's total (the driver keeps some) and the capacity as sold
        assert cap < g.cuda_total_bytes <= g.smi_total_bytes <= g.memory_bytes * 1.0001, g.name
        assert g.name in text and ctx_src and g.cuda_total_source, g.name
        assert g.usable_capacity_bytes == cap


def test_measured_totals_are_the_figures_their_sources_quote():
    # torch's out-of-memory message: "GPU 0 has a total capacity of 79.11 GiB" (vLLM issue 27508)
    assert gpus.get_gpu("H100 80GB").cuda_total_bytes == 81009 * MIB
    assert abs(81009 * MIB / GIB - 79.11) < 0.005
    # unsloth-zoo PR 1053: both capacity APIs return 50,865,307,648 bytes on an RTX 6000 Ada
    assert abs(gpus.get_gpu("RTX 6000 Ada").cuda_total_bytes - 50_865_307_648) < MIB
    # CatVTON issue 133 (T4, ECC on): 14.56 GiB
    assert abs(gpus.get_gpu("T4").cuda_total_bytes / GIB - 14.56) < 0.005


def test_context_by_generation_and_loading_mode():
    # Hopper: the H200 measurements of the validation file (env.cuda_context_mib 620.8)
    assert gpus.context_bytes("H200")[0] == pytest.approx(620.8 * MIB)
    # Ada: 426 MiB on an RTX 6000 Ada (unsloth-zoo PR 1053), a card's own figure first
    assert gpus.context_bytes("RTX 6000 Ada")[0] == 426 * MIB
    assert gpus.context_bytes("L40S")[0] == 426 * MIB
    # the RTX 3090's own measurement (vLLM issue 10517) is the Ampere figure
    assert gpus.context_bytes("RTX 3090")[0] == 358 * MIB == gpus.context_bytes("A100 80GB")[0]
    # eager module loading (torch < 1.13, or a CUDA runtime < 11.7) loads every kernel at start:
    # PR 86509 measured 666,632,192 B eager vs 287,047,680 B lazy
    lazy, _ = gpus.context_bytes("A100 80GB", torch_version="2.4", cuda_version="12.1")
    eager, why = gpus.context_bytes("A100 80GB", torch_version="1.12.1", cuda_version="11.6")
    assert eager - lazy == pytest.approx((666_632_192 - 287_047_680) / MIB * MIB, rel=1e-3)
    assert "eager" in why
    # CUDA 12.2+ loads lazily by default even under an old torch
    assert not gpus.lazy_loading("1.12", "11.8") and gpus.lazy_loading("1.12", "12.2")
    assert gpus.lazy_loading("2.11.0+cu130", None) and gpus.lazy_loading(None, None)


def test_derived_totals_say_how_they_were_derived():
    h200 = gpus.get_gpu("H200")
    reserve, why = gpus.driver_reserve_bytes("Hopper")
    # H100 80GB: nvidia-smi 81,559 MiB, torch 81,009 MiB: the driver keeps 550 MiB
    assert reserve == 550 * MIB and "H100 80GB" in why
    assert h200.cuda_total_bytes == 143771 * MIB - reserve
    assert h200.cuda_total_source.startswith("derived")
    # public out-of-memory logs of H200s read "total capacity of 139.80 GiB": within 0.1 GiB
    assert abs(h200.cuda_total_bytes / GIB - 139.80) < 0.1


def test_ecc_on_gddr_cards_moves_a_sixteenth():
    # the T4 ships with ECC on: nvidia-smi's 15,360 MiB is 16 GiB x 15/16
    g = gpus.get_gpu("T4")
    assert g.smi_total_bytes == 16 * GIB * 15 / 16
    on, _ = gpus.usable_capacity(g)
    off, text = gpus.usable_capacity(g, ecc=False)
    assert off - on == pytest.approx(g.smi_total_bytes / 15) and "ECC off" in text
    assert gpus.usable_capacity(g, ecc=True)[0] == on
    # HBM keeps ECC in sideband bits: no change
    assert gpus.usable_capacity("H100 80GB", ecc=False)[0] == gpus.usable_capacity("H100 80GB")[0]
    with pytest.raises(vw.VramError, match="ecc"):
        gpus.usable_capacity("T4", ecc="yes")
    with pytest.raises(vw.VramError, match="version"):
        gpus.usable_capacity("T4", torch_version="latest")


def test_verdict_states_the_cards_context_and_usable_capacity():
    est = vw.estimate("llama-3.2-1b", batch_size=2, seq_len=1024)
    for name in ("RTX 4090", "A100 80GB", "H200"):
        v = verdict.verdict(est, name)
        ctx, src = gpus.context_bytes(name)
        assert v["context_bytes"] == ctx
        assert v["usable_capacity_bytes"] == gpus.usable_capacity(name)[0]
        assert v["capacity_note"] == gpus.usable_capacity(name)[1]
        assert f"{verdict.mib_text(ctx)} MiB" in v["context_note"] and src in v["context_note"]
        # the judged device total counts the card's own context, whatever the estimate was made on
        assert v["need_bytes"] == est.reserved_bytes + ctx
        # where it differs from the one the estimate counts as made (no GPU: the H200's), it says so
        differs = "not the 620.8 MiB the estimate counts as made" in v["context_note"]
        assert differs == (abs(ctx - est.cuda_context_bytes) >= MIB), name


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([g.name for g in gpus.list_gpus()]),
       st.sampled_from([None, "1.12", "1.13", "2.4", "2.11"]),
       st.sampled_from([None, "11.6", "11.8", "12.2", "13.0"]),
       st.sampled_from([None, True, False]))
def test_usable_capacity_invariants(name, torch_v, cuda_v, ecc):
    """Eager loading never leaves more room than lazy; ECC on never more than off."""
    cap, text = gpus.usable_capacity(name, torch_version=torch_v, cuda_version=cuda_v, ecc=ecc)
    lazy, _ = gpus.usable_capacity(name, ecc=ecc)
    assert 0 < cap <= lazy and text
    if ecc is not None:
        assert gpus.usable_capacity(name, ecc=True)[0] <= gpus.usable_capacity(name, ecc=False)[0]
