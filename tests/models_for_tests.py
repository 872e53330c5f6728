"""Models written for the tests: a GPT-2-style decoder and a few awkward shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size(0), x.size(1), x.size(2)
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        att = att.masked_fill(mask == 0, float("-inf")).softmax(dim=-1)
        y = self.drop(att) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, blocks in a ModuleList, LM head tied to the embedding.

    The attention mask (1 = attend) comes as a keyword argument and is combined with the
    causal mask once, then read by every block.
    """

    def __init__(
        self,
        vocab: int = 50,
        width: int = 32,
        layers: int = 4,
        heads: int = 4,
        context: int = 16,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("causal", torch.tril(torch.ones(context, context)), persistent=False)

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        mask = self.causal[None, None, :t, :t] * attention_mask[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


class BranchyGPT(GPT):
    """The same decoder with data-dependent control flow: fx cannot trace it."""

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if attention_mask.sum() == 0:
            raise ValueError("empty mask")
        return super().forward(idx, attention_mask)


@dataclass
class Pair:
    main: torch.Tensor
    aux: torch.Tensor | None


class ManyOutputs(nn.Module):
    """Two positional inputs, a keyword flag, a detached and a no-grad region, nested outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.c = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.d = nn.Linear(8, 3)
        self.side = nn.Linear(2, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> dict[str, object]:
        h = self.a(x) + self.side(y)
        h = self.b(h) + self.b(h).detach()  # a detached region
        with torch.no_grad():
            stats = h.mean()  # a no-grad region
        h = self.c(h * scale)
        out = self.d(h)
        return {"pair": (out, None), "stats": stats, "tail": Pair(out * 2, h)}


class CallCounter(nn.Module):
    """Not replayable: its output depends on how often it ran, so recompute differs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.calls


def drifting_chain(width: int = 8) -> nn.Sequential:
    """A chain that ``verify`` must reject: its output depends on the number of calls."""
    return nn.Sequential(
        nn.Linear(width, width), CallCounter(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2)
    )


def tiny_lm(vocab: int = 1000, width: int = 16) -> nn.Sequential:
    """Token ids to logits over a vocabulary much wider than the model: the loss dominates."""
    return nn.Sequential(
        nn.Embedding(vocab, width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, vocab)
    )
