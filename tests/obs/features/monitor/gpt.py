"""A tiny GPT-2-style model (nanoGPT's shape: token and position embeddings, pre-norm blocks of causal attention and
an MLP, a tied head) and a made-up language to train it on: a few hundred tokens, sequences from a fixed random
Markov chain, so that the loss falls as in real training."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, block_size: int = 32, d: int = 32, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # nanoGPT's initialisation
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def language(vocab: int = 256, seed: int = 0) -> torch.Tensor:
    """A Markov chain's transition matrix: each token is followed by one of 4 tokens."""
    g = torch.Generator().manual_seed(seed)
    table = torch.zeros(vocab, vocab)
    for tok in range(vocab):
        table[tok, torch.randint(vocab, (4,), generator=g)] = 1.0
    return table / table.sum(1, keepdim=True)


def batches(steps: int, *, batch: int = 8, block: int = 32, vocab: int = 256, seed: int = 0) -> list[tuple[
        torch.Tensor, torch.Tensor]]:
    """``steps`` batches of (inputs, targets) drawn from :func:`language`."""
    table = language(vocab, seed)
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(steps):
        seq = torch.empty(batch, block + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for t in range(block):
            seq[:, t + 1] = torch.multinomial(table[seq[:, t]], 1, generator=g).squeeze(1)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out
