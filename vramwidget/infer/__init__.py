"""The lower floors of inference: what one ``generate()`` or serving run is made of.

``setup``     the run's settings and their checks (:class:`~vramwidget.infer.setup.InferenceSetup`)
``versions``  which transformers release a setup models
``weights``   every weight tensor as a storage format keeps it (bf16 ... GPTQ, AWQ, GGUF)
``kv``        what the KV cache holds per layer and token
``steps``     the live tensors of each step of one layer, and of one decode step

:mod:`vramwidget.inference_events` lays these out in time for the caching allocator and
:mod:`vramwidget.inference` (the estimate, which re-exports every public name here) reads
that replay; nothing here imports either of them.
"""
