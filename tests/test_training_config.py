"""Reading users' own training configs (issue #12, item 5).

Every file under tests/data/training_configs/ is a real example from the project that
writes that format (the README there names each source); the HF one is what transformers
5.23's ``TrainingArguments.to_json_string()`` writes, with TRL SFTConfig's fields and
PEFT's ``LoraConfig.save_pretrained()`` / ``BitsAndBytesConfig.to_dict()`` beside it.
The expected values are the settings written in those files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import vramwidget as vw
from vramwidget.readers import FORMATS, from_training_config
from vramwidget.readers._common import _leaves

HERE = os.path.join(os.path.dirname(__file__), "data", "training_configs")


def path(name: str) -> str:
    return os.path.join(HERE, name)


def knob(cfg, key):
    """A mapped value, whether or not this version of the estimator models the keyword yet."""
    if key in cfg.setup:
        return cfg.setup[key]
    hits = [v for _, k, v in cfg.mapped if k == key]
    assert hits, f"{key} was not mapped"
    assert any(key in why for _, why in cfg.ignored), f"{key} mapped but neither in setup nor said to be ignored"
    return hits[-1]


def every_field_accounted(cfg, raw) -> None:
    """Every set field of the file is either used or listed as ignored with a reason."""
    used = {f for f, _, _ in cfg.mapped} | {f for f, _ in cfg.ignored}
    for p, v in _leaves(raw):
        if v in (None, "", [], {}):
            continue
        parts = p.split(".")
        assert any(".".join(parts[:i]) in used for i in range(1, len(parts) + 1)), f"{p} neither used nor ignored"


def test_axolotl_qlora_fsdp_70b():
    # axolotl examples/llama-3/qlora-fsdp-70b.yaml
    cfg = from_training_config(path("axolotl_qlora_fsdp_70b.yaml"))
    assert cfg.format == "axolotl"
    assert cfg.model == "casperhansen/llama-3-70b-fp16"
    s = cfg.setup
    assert (s["method"], s["quantization"], s["double_quant"]) == ("qlora", "nf4", True)
    assert (s["lora_r"], s["lora_alpha"], s["lora_dropout"]) == (8, 16, 0.05)
    assert s["lora_targets"] == ("all-linear",)
    assert (s["batch_size"], s["seq_len"], s["grad_accum_steps"]) == (1, 512, 4)
    assert (s["precision"], s["gradient_checkpointing"], s["attn_implementation"]) == \
        ("bf16", "full", "flash_attention_2")
    assert s["optimizer"] == "adamw"
    assert cfg.parallel == {"strategy": "fsdp_full_shard", "offload_params": True}
    assert any("num_gpus" in n for n in cfg.notes)
    import yaml

    every_field_accounted(cfg, yaml.safe_load(open(path("axolotl_qlora_fsdp_70b.yaml"))))
    # Llama-3-70B has the layout of the llama-3-70b preset; 2 GPUs as PEFT's FSDP QLoRA guide
    est = cfg.estimate("llama-3-70b", num_gpus=2)
    assert est.per_gpu.peak_allocated_bytes > 0


def test_axolotl_liger_packing_fsdp():
    # axolotl examples/llama-3/fft-8b-liger-fsdp.yaml
    cfg = from_training_config(path("axolotl_fft_8b_liger_fsdp.yaml"))
    s = cfg.setup
    assert s["method"] == "full" and s["optimizer"] == "adamw_fused"
    assert (s["batch_size"], s["seq_len"]) == (2, 4096)
    assert knob(cfg, "loss") == "liger"
    assert knob(cfg, "packing") is True
    assert s["attn_implementation"] == "flash_attention_2"
    # Liger's elementwise kernels are named as not modelled, not silently dropped
    assert any(f == "liger_rms_norm" for f, _ in cfg.ignored)


def test_torchtune_lora_and_qlora():
    # torchtune recipes/configs/llama3_2/3B_lora_single_device.yaml and 3B_qlora_single_device.yaml
    cfg = from_training_config(path("torchtune_3B_lora_single_device.yaml"))
    assert cfg.format == "torchtune"
    assert cfg.model == "llama-3.2-3b"  # from checkpointer.checkpoint_dir /tmp/Llama-3.2-3B-Instruct/
    s = cfg.setup
    assert s["method"] == "lora"
    assert s["lora_targets"] == ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert (s["lora_r"], s["lora_alpha"], s["batch_size"], s["grad_accum_steps"]) == (64, 128, 4, 8)
    assert (s["precision"], s["gradient_checkpointing"], s["optimizer"]) == ("bf16", "full", "adamw_fused")
    assert knob(cfg, "loss") == "chunked" and knob(cfg, "loss_chunks") == 8
    assert knob(cfg, "stack") == "torchtune"
    assert "seq_len" not in s and any("max_seq_len" in n for n in cfg.notes)
    q = from_training_config(path("torchtune_3B_qlora_single_device.yaml"))
    assert (q.setup["method"], q.setup["quantization"], q.setup["double_quant"]) == ("qlora", "nf4", True)
    assert q.estimate(seq_len=2048).peak_allocated_bytes < cfg.estimate(seq_len=2048).peak_allocated_bytes


def test_torchtune_builder_name_when_no_checkpoint_dir():
    raw = {"model": {"_component_": "torchtune.models.llama2.qlora_llama2_7b", "lora_attn_modules": ["q_proj"]},
           "batch_size": 2, "dtype": "bf16", "optimizer_in_bwd": True, "enable_activation_offloading": True}
    cfg = from_training_config(raw)
    assert cfg.model == "llama-2-7b"
    assert knob(cfg, "optimizer_in_backward") is True
    assert knob(cfg, "activation_offloading") is True


def test_llamafactory_qlora_and_deepspeed():
    # LLaMA-Factory examples/train_qlora/llama3_lora_sft_otfq.yaml
    cfg = from_training_config(path("llamafactory_llama3_lora_sft_otfq.yaml"))
    assert cfg.format == "llamafactory" and cfg.model == "meta-llama/Meta-Llama-3-8B-Instruct"
    s = cfg.setup
    assert (s["method"], s["quantization"], s["double_quant"]) == ("qlora", "nf4", True)
    # LLaMA-Factory's defaults: rank 8, alpha 2 x rank, checkpointing on
    assert (s["lora_r"], s["lora_alpha"], s["gradient_checkpointing"]) == (8, 16.0, "full")
    assert (s["batch_size"], s["seq_len"], s["grad_accum_steps"], s["precision"]) == (1, 2048, 8, "bf16")
    assert cfg.estimate().peak_allocated_bytes > 0  # the model is a preset alias: resolved offline
    # examples/train_lora/llama3_lora_sft_ds3.yaml naming examples/deepspeed/ds_z3_offload_config.json
    ds = from_training_config(path("llamafactory_llama3_lora_sft_ds3.yaml"))
    assert ds.parallel["strategy"] == "zero3"
    assert ds.parallel["offload_optimizer"] is True and ds.parallel["offload_params"] is True
    assert ds.parallel["overlap_comm"] is False
    # "auto" batch in the DeepSpeed file: the YAML's per_device_train_batch_size stands
    assert ds.setup["batch_size"] == 1 and ds.setup["grad_accum_steps"] == 2
    # "auto" hidden-size keys stay "auto": estimate_parallel fills them from the model as the HF
    # integration does (hidden_size**2 ...)
    assert ds.parallel["zero_config"]["reduce_bucket_size"] == "auto"


def test_litgpt_qlora():
    # LitGPT config_hub/finetune/llama-2-7b/qlora.yaml
    cfg = from_training_config(path("litgpt_llama2_7b_qlora.yaml"))
    assert cfg.format == "litgpt" and cfg.model == "meta-llama/Llama-2-7b-hf"
    s = cfg.setup
    assert (s["method"], s["quantization"], s["double_quant"]) == ("qlora", "nf4", False)
    assert s["lora_targets"] == ("q_proj", "v_proj")
    assert (s["lora_r"], s["lora_alpha"], s["lora_dropout"]) == (32, 16, 0.05)
    # global 8 = micro 2 x 1 device x 4 accumulation steps
    assert (s["batch_size"], s["grad_accum_steps"], s["seq_len"], s["precision"]) == (2, 4, 512, "bf16")
    assert knob(cfg, "stack") == "litgpt"
    assert cfg.parallel == {}
    assert cfg.estimate().peak_allocated_bytes > 0


def test_deepspeed_json_alone():
    # LLaMA-Factory examples/deepspeed/ds_z3_offload_config.json
    cfg = from_training_config(path("examples/deepspeed/ds_z3_offload_config.json"))
    assert cfg.format == "deepspeed" and cfg.model is None
    assert cfg.parallel == {"strategy": "zero3", "offload_optimizer": True, "offload_params": True,
                            "overlap_comm": False, "zero_config": {
                                "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto", "sub_group_size": 1e9,
                                "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                "contiguous_gradients": True}}
    with pytest.raises(vw.VramError, match="names no model"):
        cfg.estimate()
    ds = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8, "overlap_comm": True},
          "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}}
    c2 = from_training_config(ds)
    # 2e8 elements of 16-bit gradients = 400 MB
    assert c2.parallel == {"strategy": "zero2", "bucket_mb": 400.0, "overlap_comm": True}
    assert (c2.setup["batch_size"], c2.setup["precision"]) == (4, "bf16")
    two = c2.estimate("llama-3.2-1b", num_gpus=2)
    four = c2.estimate("llama-3.2-1b", num_gpus=4)
    assert four.per_gpu.peak_allocated_bytes < two.per_gpu.peak_allocated_bytes  # ZeRO-2 shards over more GPUs


def test_accelerate_fsdp_and_deepspeed():
    # PEFT examples/sft/configs/fsdp_config_qlora.yaml and deepspeed_config_z3_qlora.yaml
    f = from_training_config(path("accelerate_fsdp_config_qlora.yaml"))
    assert f.format == "accelerate"
    assert f.parallel == {"num_gpus": 2, "strategy": "fsdp_full_shard", "offload_params": True}
    d = from_training_config(path("accelerate_deepspeed_config_z3_qlora.yaml"))
    assert d.parallel == {"num_gpus": 2, "strategy": "zero3"}
    assert d.setup == {"precision": "amp_bf16"}
    est = d.estimate("llama-3.2-1b")
    assert est.per_gpu.peak_allocated_bytes > 0


def test_fsdp2_read_from_each_launcher():
    """FSDP2 and its reshard_after_forward as accelerate >= 1.6 (fsdp_config.fsdp_version),
    transformers 5 (fsdp_config.version, default 2), torchtune's distributed recipes (always
    fully_shard) and axolotl >= 0.10 (top-level fsdp_version) write them."""
    acc = {"distributed_type": "FSDP", "num_processes": 4, "compute_environment": "LOCAL_MACHINE",
           "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False, "fsdp_offload_params": True}}
    assert from_training_config(acc).parallel == {
        "num_gpus": 4, "fsdp_version": 2, "strategy": "fsdp_shard_grad_op", "reshard_after_forward": False,
        "offload_params": True}
    acc1 = {"distributed_type": "FSDP", "num_processes": 2, "compute_environment": "LOCAL_MACHINE",
            "fsdp_config": {"fsdp_reshard_after_forward": "HYBRID_SHARD"}}
    assert from_training_config(acc1).parallel == {"num_gpus": 2, "strategy": "fsdp_hybrid"}
    hf5 = {"per_device_train_batch_size": 1, "output_dir": "o", "fsdp": True,
           "fsdp_config": {"reshard_after_forward": True}}
    assert from_training_config(hf5).parallel == {"fsdp_version": 2, "strategy": "fsdp_full_shard"}
    hf4 = {"per_device_train_batch_size": 1, "output_dir": "o", "fsdp": "shard_grad_op auto_wrap"}
    assert from_training_config(hf4).parallel == {"strategy": "fsdp_shard_grad_op"}
    hf1 = {"per_device_train_batch_size": 1, "output_dir": "o", "fsdp": True,
           "fsdp_config": {"version": 1, "reshard_after_forward": "hybrid_shard"}}
    assert from_training_config(hf1).parallel == {"strategy": "fsdp_hybrid"}
    tt = {"model": {"_component_": "torchtune.models.llama3_2.llama3_2_1b"}, "batch_size": 2,
          "fsdp_cpu_offload": False, "fsdp_reshard_after_forward": False}
    assert from_training_config(tt).parallel == {"strategy": "fsdp_shard_grad_op", "fsdp_version": 2,
                                                 "reshard_after_forward": False}
    ax = {"base_model": "meta-llama/Llama-3.2-1B", "micro_batch_size": 1, "sequence_len": 512,
          "fsdp_version": 2, "fsdp_config": {"offload_params": False, "reshard_after_forward": True}}
    assert from_training_config(ax).parallel == {"fsdp_version": 2, "reshard_after_forward": True,
                                                 "strategy": "fsdp_full_shard"}
    est = from_training_config(acc).estimate("llama-3.2-1b")
    assert est.per_gpu.peak_allocated_bytes > 0


def test_hf_training_arguments_with_peft_and_bnb_beside():
    cfg = from_training_config(path("hf_sft_qlora/training_args.json"))
    assert cfg.format == "hf"
    assert cfg.model == "meta-llama/Llama-3.1-8B"  # adapter_config.json's base_model_name_or_path
    s = cfg.setup
    assert (s["batch_size"], s["grad_accum_steps"], s["seq_len"]) == (2, 8, 2048)
    assert (s["method"], s["quantization"], s["double_quant"]) == ("qlora", "nf4", True)
    assert (s["lora_r"], s["lora_alpha"], s["lora_targets"]) == (16, 32, ("all-linear",))
    assert (s["optimizer"], s["gradient_checkpointing"], s["precision"]) == ("paged_adamw_8bit", "full", "bf16")
    every_field_accounted(cfg, json.load(open(path("hf_sft_qlora/training_args.json"))))
    est = cfg.estimate()
    assert est.peak_allocated_bytes == vw.estimate("llama-3.1-8b", **s).peak_allocated_bytes


def test_hf_pasted_dict_and_transformers4_fsdp():
    raw = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "optim": "adamw_torch_fused",
           "output_dir": "o", "fp16": True, "fsdp": "full_shard auto_wrap offload", "torch_compile": True,
           "peft_config": {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                           "use_dora": True, "modules_to_save": ["lm_head"]}}
    cfg = from_training_config(raw)
    assert cfg.setup["precision"] == "amp_fp16" and cfg.setup["optimizer"] == "adamw_fused"
    assert cfg.parallel == {"strategy": "fsdp_full_shard", "offload_params": True}
    assert knob(cfg, "lora_variant") == "dora"
    assert knob(cfg, "modules_to_save") == ("lm_head",)
    assert knob(cfg, "compile") is True


@pytest.mark.parametrize("bad, match", [
    ({"foo": 1, "bar": 2}, "not a training config"),
    ({"base_model": "llama-2-7b", "micro_batch_size": "x"}, None),
])
def test_unreadable_configs_say_why(bad, match):
    if match:
        with pytest.raises(vw.VramError, match=match):
            from_training_config(bad)
    else:
        cfg = from_training_config(bad)  # a non-number batch is listed, not used
        assert "batch_size" not in cfg.setup


def test_file_errors(tmp_path):
    with pytest.raises(vw.VramError, match="no such file"):
        from_training_config(str(tmp_path / "nope.yaml"))
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(vw.VramError, match="not a mapping"):
        from_training_config(str(p))
    j = tmp_path / "bad.json"
    j.write_text("{nope")
    with pytest.raises(vw.VramError, match="not valid JSON"):
        from_training_config(str(j))
    with pytest.raises(vw.VramError, match="format"):
        from_training_config({"a": 1}, format="kubeflow")
    with pytest.raises(vw.VramError, match="expected a file path or a dict"):
        from_training_config(5)
    # a conflict inside the file is named with the file
    with pytest.raises(vw.VramError, match="axolotl"):
        from_training_config({"base_model": "x", "micro_batch_size": 1, "load_in_4bit": True, "adapter": None})


def test_formats_listed():
    assert set(FORMATS) == {"hf", "axolotl", "torchtune", "llamafactory", "litgpt", "deepspeed", "accelerate"}


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "vramwidget", *args], capture_output=True, text=True, timeout=120,
                          env=None if env is None else {**os.environ, **env})


def test_cli_estimate_from_file(tmp_path):
    r = _cli("estimate", "--from", path("llamafactory_llama3_lora_sft_otfq.yaml"), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["config"]["format"] == "llamafactory"
    assert d["setup"]["method"] == "qlora" and d["setup"]["seq_len"] == 2048
    # MODEL on the command line overrides the file's; options override its settings
    r2 = _cli("estimate", "llama-3.2-1b", "--from", path("llamafactory_llama3_lora_sft_otfq.yaml"),
              "--seq-len", "512", "--json")
    d2 = json.loads(r2.stdout)
    assert d2["architecture"]["name"] == "llama-3.2-1b" and d2["setup"]["seq_len"] == 512
    text = _cli("estimate", "llama-3-70b", "--from", path("axolotl_qlora_fsdp_70b.yaml"), "--num-gpus", "2")
    assert text.returncode == 0, text.stderr
    assert "as an axolotl config" in text.stdout and "per GPU, the worst one (strategy=fsdp_full_shard" in text.stdout
    none = _cli("estimate", "--from", path("accelerate_fsdp_config_qlora.yaml"))
    assert none.returncode == 2 and "names no model" in none.stderr
    missing = _cli("estimate")
    assert missing.returncode == 2 and "MODEL" in missing.stderr
    # the file names a Hub repo this (offline) machine cannot fetch: the error says how to keep
    # the file's setup and name the model on the command line
    offline = _cli("estimate", "--from", path("axolotl_fft_8b_liger_fsdp.yaml"),
                   env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert offline.returncode == 2 and "NousResearch/Meta-Llama-3.1-8B" in offline.stderr
    assert "vramwidget estimate MODEL --from axolotl_fft_8b_liger_fsdp.yaml" in offline.stderr
