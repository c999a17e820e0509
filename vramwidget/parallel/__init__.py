"""Beyond one GPU: what each GPU of a multi-GPU run holds.

``strategies``      the data-parallel strategies as data (``data/strategies.json``)
``estimate``        :func:`estimate_parallel`: the layout (data, tensor, pipeline, context and
                    expert parallel), each stage's slice and its per-GPU estimate
``zero``            DeepSpeed ZeRO stages 0-3 as DeepSpeed steps them
``fsdp``            FSDP1 flat parameters and FSDP2 ``fully_shard``
``sharded_replay``  one GPU's own tensors in time, for the caching allocator
``device_map``      transformers' ``device_map="auto"`` placement of whole layers
"""
