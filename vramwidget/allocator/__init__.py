"""PyTorch's caching allocator, replayed over the step plan's events.

``caching``   the allocator itself (rounding, splitting, best fit, free-and-retry at capacity),
              after c10/cuda/CUDACachingAllocator.cpp
``replays``   replays run when a reserve, a verdict or a snapshot is read, cached
``collector`` Python's cyclic collector paused while plans are written and searched
``snapshot``  reading ``torch.cuda.memory._snapshot()`` files into the estimate's terms
``paged``     paged optimizer states (unified memory, outside the caching allocator)
"""
