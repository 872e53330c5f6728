"""Using autockpt through training frameworks, without editing the training loop.

``autockpt.integrations.transformers``: ``enable``/``disable``, the one-line replacement for
Hugging Face's ``model.gradient_checkpointing_enable()``, and ``AutoCheckpointCallback`` for
its ``Trainer``. ``autockpt.integrations.lightning``: ``AutoCheckpoint``, a callback for
``lightning.Trainer``. Each integration imports its framework; this package imports none.
"""
