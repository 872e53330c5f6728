"""Executing a plan: the forward installed on a checkpointed model and the runtime under it.

``forward`` holds what ``model.forward`` becomes (and what a checkpointed block's forward
becomes), including the one-time dry run and re-planning; ``runtime`` runs segments through
``torch.utils.checkpoint`` with exact buffers, RNG and the mutation guard.
"""
