"""Callbacks that track a model trained by a framework's own loop.

``tandv.integrations.lightning.TandvCallback`` for PyTorch Lightning and
``tandv.integrations.hf.TandvCallback`` for the HuggingFace ``transformers.Trainer``. Each
takes the keyword options of :func:`tandv.track.torch.track` and calls ``tracker.step()``
once per optimizer update, so gradient accumulation, closures and optimizer wrappers need
no glue. Import the module of the framework you use (each imports its framework).
"""
