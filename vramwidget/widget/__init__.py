"""The notebook widget: controls, summary and treemaps, recomputed on every change.

``Calculator`` is an anywidget.  The code is split by job, so a change to one panel touches
one module:

* :mod:`.state`: every input and output trait, and the names that group them;
* :mod:`.controls`: how each input is drawn and where it sits (the frontend's one list of them);
* :mod:`.training`: training on one GPU (setup, scenarios, linked controls, summary);
* :mod:`.multigpu`: training on several GPUs (layout, stages, CPU offload);
* :mod:`.inference`: generate() and serving (weight formats, KV cache, longest context);
* :mod:`.suggestions`: what to change when it does not fit, worked out after the update;
* :mod:`.views`: chart sizes and specs, the component table, the comparison's captions, the
  charts laid out for the frontend's column width;
* :mod:`.formats`: the number-format panel;
* :mod:`.background`, :mod:`.worker`: what an update leaves for later (exact allocator
  replays, a traced model, the fit map, suggestions) and the threads that do it;
* :mod:`.calculator`: the ``Calculator`` class that joins them, its observer and update.

The frontend (``static/widget.js``, built from ``js/src/``, one file per panel) embeds each
chart spec once and afterwards swaps only its rows, so an update moves a few kilobytes.
"""

from .calculator import Calculator
from .formats import number_formats
from .inference import INFERENCE_SCENARIOS
from .state import (DEFAULT_MODEL, ESTIMATE_INPUTS, INFERENCE_INPUTS, INFERENCE_KEYWORDS, INPUTS, MODES,
                    PARALLEL_DEFAULTS, PARALLEL_INPUTS, TRAINING_ONLY)
from .training import SCENARIOS, YOUR_SETUP
from .views import COMPARISON_SIZE, DETAIL_SIZE, PHASE_SIZE

__all__ = [
    "Calculator", "number_formats", "DEFAULT_MODEL", "MODES", "INPUTS", "ESTIMATE_INPUTS",
    "PARALLEL_DEFAULTS", "PARALLEL_INPUTS", "INFERENCE_KEYWORDS", "INFERENCE_INPUTS", "TRAINING_ONLY",
    "SCENARIOS", "INFERENCE_SCENARIOS", "YOUR_SETUP", "DETAIL_SIZE", "COMPARISON_SIZE", "PHASE_SIZE",
]
