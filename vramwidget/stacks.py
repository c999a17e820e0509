"""Training stacks as data: the setup defaults each one really uses, and where its model or
loss code keeps different tensors than transformers + PEFT.

A stack is two dictionaries, read from that stack's own source (cited per entry):

``defaults``   setup fields the stack sets when the user does not (``TrainingSetup.from_kwargs``
               fills them in; anything the user passes wins);
``behaviour``  how its code differs from transformers + PEFT, as switches the estimator reads
               (it never looks at the stack's name):

  ``adapter_dtype``        "float32": PEFT keeps LoRA weights in fp32 and casts each adapted
                           input to fp32 (peft tuners/lora/layer.py); "weights": the adapters
                           are created in the model's dtype and use its input as it is.
  ``logits_fp32_in_model`` the model itself returns ``output(h).float()`` (torchtune
                           modules/transformer.py ``unembed``), so the fp32 logits are held by
                           the caller and the 16-bit ones are a transient.
  ``loss_upcast``          the loss casts the logits to fp32 before log_softmax (HF's
                           ForCausalLMLoss, torchtune's losses); LitGPT's
                           ``chunked_cross_entropy`` runs on the 16-bit logits.
  ``fused_qkv_lora``       one LoRA input (dropout mask, dropped copy) for the fused qkv
                           projection (LitGPT's LoRAQKVLinear) instead of one per q/k/v; when
                           not all of q, k, v are adapted, its zero_pad keeps the lora_B output
                           (activations.linear).
  ``packed_sdpa``          packed sequences run through SDPA/flex attention with a document
                           mask kept per kernel (no b x s x s mask tensor), as varlen flash does.

Adding a stack is adding an entry here; nothing else changes.
"""

from __future__ import annotations

import math
from typing import Any, Dict

#: behaviour of transformers + PEFT (the measured stack); other stacks override entries
HF_BEHAVIOUR: Dict[str, Any] = {
    "adapter_dtype": "float32",
    "logits_fp32_in_model": False,
    "loss_upcast": True,
}

STACKS: Dict[str, Dict[str, Any]] = {
    "hf": {
        "label": "Hugging Face Trainer / TRL / PEFT",
        # transformers TrainingArguments: optim="adamw_torch", no checkpointing, no packing;
        # TRL SFTConfig leaves the loss to the model (use_liger_kernel=False)
        "defaults": {},
        "behaviour": {},
        # TrainingArguments.use_liger_kernel (liger_kernel.transformers apply_liger_kernel_to_*
        # patches the causal LM's forward with LigerFusedLinearCrossEntropy); TRL's
        # SFTConfig.activation_offloading (trl/models/activation_offloading.py)
        "switches": {"loss": ("liger", "pip install liger-kernel, then use_liger_kernel=True in TrainingArguments "
                                       "/ SFTConfig"),
                     "activation_offloading": "TRL: activation_offloading=True in SFTConfig"},
        "sources": ("transformers src/transformers/training_args.py", "peft src/peft/tuners/lora/layer.py"),
    },
    "axolotl": {
        "label": "axolotl",
        # axolotl builds HF Trainer + PEFT models; its schema's defaults:
        # src/axolotl/utils/schemas/training.py optimizer="adamw_torch_fused",
        # src/axolotl/utils/schemas/config.py bf16="auto" (bf16 weights on Ampere and later),
        # gradient_checkpointing=False, sample_packing=None, no Liger; peft.py lora_dropout=0.0.
        "defaults": {"optimizer": "adamw_fused", "precision": "bf16"},
        "behaviour": {},
        # src/axolotl/integrations/liger (LigerPlugin: liger_fused_linear_cross_entropy) and the
        # schema's activation_offloading option
        "switches": {"loss": ("liger", "plugins: [axolotl.integrations.liger.LigerPlugin] and "
                                       "liger_fused_linear_cross_entropy: true"),
                     "activation_offloading": "activation_offloading: true"},
        "sources": ("axolotl src/axolotl/utils/schemas/training.py", "axolotl src/axolotl/utils/schemas/config.py"),
    },
    "torchtune": {
        "label": "torchtune",
        # recipes/configs/llama3_2/3B_lora_single_device.yaml (and 150 other configs): dtype
        # bf16 (model, LoRA and optimizer states in bf16: training.set_default_dtype),
        # torch.optim.AdamW with fused: True, compile False, optimizer_in_bwd only where a
        # config sets it, enable_activation_offloading False.  LoRA layers
        # (torchtune/modules/peft/lora.py) are built in the model's dtype and take x as it is.
        # The model returns output(h).float() unless the loss chunks the output.
        "defaults": {"precision": "bf16", "optimizer": "adamw_fused"},
        # packed batches run flex attention with a document mask (torchtune/modules/attention_utils.py)
        "behaviour": {"adapter_dtype": "weights", "logits_fp32_in_model": True, "packed_sdpa": True},
        # torchtune/modules/loss/ce_chunked_output_loss.py, training/_activation_offloading.py,
        # recipes/full_finetune_single_device.py (optimizer_in_bwd)
        "switches": {"loss": ("chunked", "loss: _component_: torchtune.modules.loss.CEWithChunkedOutputLoss"),
                     "activation_offloading": "enable_activation_offloading: True",
                     "optimizer_in_backward": "optimizer_in_bwd: True (full_finetune_single_device)"},
        "sources": ("torchtune recipes/configs/llama3_2/3B_full_single_device.yaml",
                    "torchtune torchtune/modules/transformer.py (unembed: output(h).float())",
                    "torchtune torchtune/modules/peft/lora.py"),
    },
    "litgpt": {
        "label": "LitGPT",
        # finetune/lora.py: precision bf16-true, r=8, alpha=16, LoRA on the query and value
        # slices of the fused qkv (lora_query, lora_value; key, projection, mlp, head off),
        # model(..., lm_head_chunk_size=128) + utils.chunked_cross_entropy (cross_entropy per
        # 128-token chunk, no fp32 upcast); adapters in the model's dtype (lit_gpt/lora.py).
        # The fused qkv's q, k, v are reshaped copies, the same bytes as separate projections.
        # --quantize bnb.*: Lightning's BitsandbytesPrecision (lightning/fabric/plugins/precision/
        # bitsandbytes.py) swaps every torch.nn.Linear built under fabric.init_module for a
        # bitsandbytes Linear4bit, the lm_head included ("bnb.nf4": no double quantization,
        # "bnb.nf4-dq": compress_statistics=True).
        "defaults": {"precision": "bf16", "lora_r": 8, "lora_alpha": 16.0, "lora_dropout": 0.05,
                     "lora_targets": ("q_proj", "v_proj"), "loss": "chunked",
                     "quantized_groups": ("attn_qk", "attn_vo", "mlp", "lm_head")},
        "behaviour": {"adapter_dtype": "weights", "loss_upcast": False, "loss_chunk_tokens": 128,
                      "fused_qkv_lora": True},
        "sources": ("litgpt finetune/lora.py (2023: lm_head_chunk_size=128, chunked_cross_entropy)",
                    "litgpt lit_gpt/utils.py chunked_cross_entropy", "litgpt lit_gpt/lora.py LoRAQKVLinear"),
    },
    "unsloth": {
        "label": "Unsloth",
        # unsloth/models/llama.py: get_peft_model(..., use_gradient_checkpointing="unsloth"),
        # unsloth_zoo's Unsloth_Offloaded_Gradient_Checkpointer (imported in
        # unsloth/models/_utils.py) moves each checkpointed layer input to the CPU; with labels
        # the causal-LM forward calls unsloth_fused_ce_loss(hidden_states, lm_head_weight, ...)
        # and returns EMPTY_LOGITS ("Fused CE never materializes logits"): a fused linear
        # cross-entropy over chunks of rows, modelled by the Liger mechanism.  LoRA via PEFT.
        "defaults": {"gradient_checkpointing": "full", "activation_offloading": True, "precision": "bf16",
                     "loss": "liger"},
        "behaviour": {},
        "sources": ("unsloth unsloth/models/llama.py (use_gradient_checkpointing='unsloth', unsloth_fused_ce_loss)",
                    "unsloth unsloth/models/_utils.py (Unsloth_Offloaded_Gradient_Checkpointer)"),
    },
}


def stack_switches(stack: str) -> Dict[str, Any]:
    """The memory knobs ``stack`` has and how its users turn each on (its own config key):
    ``loss`` -> (the loss it ships without full logits, how), ``activation_offloading`` and
    ``optimizer_in_backward`` -> how.  Knobs a stack uses by default are not listed."""
    return dict(STACKS.get(stack, {}).get("switches", {}))


def stack_defaults(stack: str, given: Dict[str, Any]) -> Dict[str, Any]:
    """The setup fields ``stack`` sets when the user has not (``given``: the user's keywords).
    An unknown stack sets nothing: the setup's own check names it (a widget trait holding a
    typo must not raise KeyError while the controls are linked)."""
    if stack not in STACKS:
        return {}
    d = dict(STACKS[stack]["defaults"])
    tokens = STACKS[stack]["behaviour"].get("loss_chunk_tokens")
    if tokens and given.get("loss_chunks") is None:
        # LitGPT splits the head and the loss every 128 tokens of the sequence
        d["loss_chunks"] = max(1, math.ceil(int(given.get("seq_len") or 2048) / tokens))
    return d


def behaviour(stack: str) -> Dict[str, Any]:
    """How ``stack``'s code differs from transformers + PEFT (see the module docstring)."""
    return {**HF_BEHAVIOUR, **STACKS[stack]["behaviour"]}
