"""Ground truth: measuring real runs on a GPU and judging the estimator by them.

``training``   ``vramwidget measure``: one training step's peaks on a GPU, recorded as a case
``inference``  ``vramwidget measure-inference``: a generate() run's peaks, recorded as a case
``validate``   ``vramwidget validate``: every recorded case against the estimate
"""
