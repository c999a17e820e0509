"""Does it fit, and what to change so it does.

``verdict``    one measure, three states (fits, tight, does not fit) and the band of the
               estimator's measured error (``data/uncertainty.json``)
``solver``     the largest batch and sequence, the fewest GPUs, the suggestions, ``vramwidget fit``
``fitmap``     the whole batch x sequence grid from the step plan's polynomials at once
``scenarios``  setups side by side (BF16, FP32, quantized; the README's comparisons)
"""
