"""A GPT-2-style decoder from Hugging Face's ``GPT2LMHeadModel``, at the size the docs use.

The reference decoder of the trade-off pictures and benchmarks: 12 layers, n_embd 256,
4 heads, 256 positions, GPT-2's vocabulary, random weights (nothing is downloaded). It
needs ``transformers`` (the ``transformers`` extra), imported only when it is built.
"""

from __future__ import annotations

from torch import nn

__all__ = ["gpt2_decoder"]


def gpt2_decoder(layers: int = 12, embd: int = 256, heads: int = 4, positions: int = 256) -> nn.Module:
    """A randomly initialised ``GPT2LMHeadModel``; ``model(input_ids).logits`` are
    ``(batch, tokens, 50257)``. It returns no key/value cache (``use_cache=False``): in
    training nothing reads it.

    Raises:
        ImportError: transformers is not installed.
    """
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            "gpt2_decoder needs transformers: pip install transformers (or autockpt[transformers])"
        ) from err
    config = transformers.GPT2Config(n_layer=layers, n_embd=embd, n_head=heads, n_positions=positions)
    config.use_cache = False
    return transformers.GPT2LMHeadModel(config)
