"""Executing a plan: the forward installed on a checkpointed model and the runtime under it.

``forward`` holds what ``model.forward`` becomes (and what a checkpointed block's forward
becomes), including the one-time dry run; when the chain changes under it, it asks the
``Replanner`` it was given for a new plan. ``runtime`` runs segments through
``torch.utils.checkpoint`` (or ``lean_checkpoint``, the same contract with less Python)
with exact buffers, RNG and the mutation guard (``hooks`` for its hook part);
``recompute_check`` compares each recompute with its forward; ``checkpoint_args`` decides
what a checkpoint call needs (devices, RNG); ``policies`` are the op policies.
"""
