"""Measuring: the dry run, stage and model profiles, the loss, and peak memory.

Everything autockpt knows about a model's costs comes from here: ``dry_run`` (in-place
modules and boundary bytes), ``stage_profile`` (one stage at a time), ``profile`` (the
``Profile`` they make), ``blocks`` (a model walked by blocks, in one real step),
``model_profile`` (the public ``profile`` and its cache), ``losses`` (the loss and the one
training step every measurement runs), ``step`` (a measured step for ``verify`` and
``check=True``), ``memory`` (``track_memory`` and allocator windows), ``allocator`` (the CPU
and CUDA allocator sessions under them), ``timeline`` (memory through one step),
``sandbox`` (runs that leave no trace: buffers, RNG, ``is_recomputing``) and ``tensors``.
"""
