"""vramwidget: how much GPU memory a training run needs, where it goes, and what to change so it fits.

    import vramwidget as vw
    est = vw.estimate("llama-3.1-8b", method="qlora", batch_size=4, seq_len=2048)
    est.peak_gib, est.to_dataframe(), vw.chart(est)
    vw.Calculator("llama-2-7b")          # the notebook widget
"""

from .model.architecture import Architecture, custom, from_config, from_param_count, load as load_architecture
from .errors import VramError
from .estimate import estimate
from .fit.solver import max_batch_size, max_seq_len, min_gpus, suggestions
from .fit.fitmap import fit_map
from .inference.estimate import longest_context
from .inference.split import estimate_inference
from .parallel.estimate import estimate_parallel
from .model.presets import list_presets
from .readers import TrainingConfig, from_training_config
from .result import Estimate, Node
from .allocator.snapshot import load_snapshot
from .training import CHOICES, TrainingSetup

__version__ = "0.1.0"

__all__ = ["Architecture", "CHOICES", "Calculator", "ChartView", "Estimate", "Node", "TrainingConfig", "TrainingSetup", "VramError", "chart", "custom",
           "estimate", "estimate_inference", "estimate_parallel", "fit_map", "from_config", "from_param_count", "from_training_config", "list_presets",
           "load_architecture", "load_snapshot", "longest_context", "max_batch_size", "max_seq_len", "min_gpus", "show", "suggestions",
           "__version__"]


def __getattr__(name):  # the widget (ipywidgets/anywidget) and charts (altair) are imported only when asked for
    if name == "Calculator":
        from .widget import Calculator

        return Calculator
    if name == "chart":  # altair is imported only when a chart is asked for
        from .show.charts import detail_chart

        return detail_chart
    if name in ("ChartView", "show"):
        from .show import chartview

        return getattr(chartview, name)
    raise AttributeError(f"module 'vramwidget' has no attribute {name!r}")
