"""Inference: what one ``generate()`` or serving run holds, and the engines that serve it.

``setup``     the run's settings and their checks (:class:`~vramwidget.inference.setup.InferenceSetup`)
``versions``  which transformers release a setup models
``weights``   every weight tensor as a storage format keeps it (bf16 ... GPTQ, AWQ, GGUF)
``kv``        what the KV cache holds per layer and token
``steps``     the live tensors of each step of one layer, and of one decode step
``generate_ops``  generate()'s ops, one by one, as transformers runs them
``events``    the prefill and decode laid out in time for the caching allocator
``estimate``  :func:`estimate_inference`'s single-GPU estimate and ``longest_context``
``split``     the public entry: one GPU, a device_map split or tensor parallel
``engines``   serving engines (vLLM, SGLang, TGI): their memory budget and KV pages

:mod:`vramwidget.inference.events` lays these out in time for the caching allocator and
:mod:`vramwidget.inference.estimate` (the estimate, which re-exports every public name here) reads
that replay; the lower floors (setup ... steps) import neither of them.
"""
