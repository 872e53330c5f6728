"""Measuring: the dry run, stage and model profiles, the loss, and peak memory.

Everything autockpt knows about a model's costs comes from here: ``dry_run`` (in-place
modules and boundary bytes), ``profiling`` (one stage at a time), ``blocks`` (a model walked
by blocks, in one real step), ``model_profile`` (the public ``profile`` and its cache),
``losses``, ``step`` (one measured training step), ``memory`` (``track_memory`` and
allocator windows) and ``allocator`` (the CPU and CUDA allocator sessions under them).
"""
