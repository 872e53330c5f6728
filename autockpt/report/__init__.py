"""Reports on a checkpointed model: what it changes, what it trades, what compile makes of it.

``verification`` (``verify``: gradients, outputs and peaks against the unwrapped model),
``tradeoff`` (plans from the floor to no checkpointing, side by side) and ``compile_check``
(which segments torch.compile cannot capture whole). They run the pipeline; nothing in it
runs them.
"""
