"""Key/value caches never cross a recompute: checkpointed blocks run without one."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_same_state
from torch import nn

import autockpt


class Cache:
    """Stands in for Hugging Face's ``Cache``: recognised by its class name."""


class KeyValueCache(Cache):
    def __init__(self) -> None:
        self.keys: list[list[torch.Tensor]] = []

    def update(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Append ``k`` to the layer's keys and return all of them, as a KV cache does."""
        while len(self.keys) <= layer:
            self.keys.append([])
        self.keys[layer].append(k)
        return torch.cat(self.keys[layer], dim=1)


class Layer(nn.Module):
    def __init__(self, index: int, width: int = 8) -> None:
        super().__init__()
        self.index = index
        self.key = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(
        self, h: torch.Tensor, cache: KeyValueCache | None = None, use_cache: bool = False
    ) -> torch.Tensor:
        k = self.key(h)
        if use_cache and cache is not None:
            k = cache.update(self.index, k)
        scores = torch.einsum("bqd,bkd->bqk", h, k).softmax(-1)  # shape depends on the cache
        return h + self.out(torch.einsum("bqk,bkd->bqd", scores, k))


class Decoder(nn.Module):
    """Builds a fresh cache each call when ``use_cache``, as HF decoders do in training."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(i) for i in range(layers))

    def forward(self, h: torch.Tensor, use_cache: bool = True) -> tuple[torch.Tensor, KeyValueCache | None]:
        cache = KeyValueCache() if use_cache else None
        if h.sum() > 1e9:  # data-dependent control flow: fx cannot trace it, the block walker runs
            h = h * 2
        for layer in self.layers:
            h = layer(h, cache=cache, use_cache=use_cache)
        return h, cache


def test_checkpointed_blocks_run_without_a_cache_and_train_exactly() -> None:
    torch.manual_seed(0)
    model, x = Decoder(), torch.randn(2, 5, 8)
    ref = copy.deepcopy(model)
    ck = autockpt.auto_checkpoint(model, segments=4)
    assert autockpt.make_plan(copy.deepcopy(ref), segments=4).walker == "blocks"
    out_ref, _ = ref(x, use_cache=False)
    out_ref.sum().backward()
    out, cache = ck(x)  # with use_cache=True: a recompute would append to the cache again
    out.sum().backward()
    assert torch.equal(out, out_ref)
    assert_same_state(ref, ck)
    assert cache is None  # called with use_cache=False, as Hugging Face's checkpointing calls it


def test_a_use_cache_given_positionally_or_outside_training_is_left_alone() -> None:
    torch.manual_seed(0)
    ck, x = autockpt.auto_checkpoint(Decoder(), segments=4), torch.randn(2, 5, 8)
    _, cache = ck(x, True)  # positional: the call is the caller's; blocks still drop the cache
    assert cache is not None and all(not keys for keys in cache.keys)
    ck.eval()
    assert ck(x)[1] is not None


def test_without_gradients_blocks_keep_their_cache() -> None:
    torch.manual_seed(0)
    model, x = Decoder(), torch.randn(2, 5, 8)
    ref = copy.deepcopy(model)
    ck = autockpt.auto_checkpoint(model, segments=4)
    with torch.no_grad():
        out, cache = ck(x)
        out_ref, cache_ref = ref(x)
    assert torch.equal(out, out_ref)
    assert [len(k) for k in cache.keys] == [len(k) for k in cache_ref.keys] == [1] * 4


def test_a_budget_profile_measures_blocks_without_the_models_cache() -> None:
    """Measuring a block alone, then running it in the step, appended to the model's cache
    twice: the step's attention reached into the measurement's freed graph."""
    torch.manual_seed(0)
    model, x = Decoder(), torch.randn(8, 16, 8)
    ref = copy.deepcopy(model)
    prof = autockpt.profile(model, (x,), loss_fn=lambda out: out[0].sum())
    assert prof.walker == "blocks" and len(prof.costs) == 9  # 4 blocks and the 5 gaps around them
    ck = autockpt.auto_checkpoint(model, budget=1.0, example_inputs=(x,), loss_fn=lambda out: out[0].sum())
    out_ref, _ = ref(x, use_cache=False)
    out_ref.sum().backward()
    out, _ = ck(x)
    out.sum().backward()
    assert_same_state(ref, ck)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_decoders_train_exactly_on_a_padded_batch(arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                         bos_token_id=0, eos_token_id=0)  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(1, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ref = copy.deepcopy(model)
    ck = autockpt.auto_checkpoint(model, example_kwargs=kwargs)
    hf = copy.deepcopy(ref)
    (getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable)()  # v5, v4
    outs = []
    for m in (ref, ck, hf):
        torch.manual_seed(1)
        outs.append(m(**kwargs))
        outs[-1].loss.backward()
    assert_same_state(ref, ck)
    # no cache built while training (NOTE [No cache built while training]), as with HF's own
    assert outs[1].past_key_values is None and outs[2].past_key_values is None


def test_use_cache_is_found_through_a_wrapper_of_the_class_forward() -> None:
    """``inspect.signature`` follows ``functools.wraps`` to the class's forward, whose ``self``
    put ``use_cache`` one place too far: ``ck(x, True)`` got it twice (found in review)."""
    import functools

    torch.manual_seed(0)
    model, x = Decoder(), torch.randn(2, 5, 8)
    forward = type(model).forward

    @functools.wraps(forward)
    def wrapped(*args: object, **kwargs: object) -> object:
        return forward(model, *args, **kwargs)  # type: ignore[arg-type]

    model.forward = wrapped  # type: ignore[method-assign]
    ck = autockpt.auto_checkpoint(model, segments=4)
    _, cache = ck(x, True)  # positional: left as given
    assert cache is not None
    assert ck(x)[1] is None  # by keyword default: switched off while training
