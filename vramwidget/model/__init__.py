"""The model: what a checkpoint is, before any setup touches it.

``architecture``  an :class:`~vramwidget.model.architecture.Architecture` from a preset, a
                  config.json, a Hub id or a parameter count
``families/``     one plug-in module per model family (its parameter tensors and block trace)
``activations``   the saved-tensor vocabulary the families' block traces are written in
``tensors``       parameter tensors and the helpers families build them with
``presets``       the shipped presets (``vramwidget/presets/*.json``)
``hub``           reading a config.json from the Hugging Face Hub
"""
