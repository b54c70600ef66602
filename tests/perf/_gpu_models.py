"""The GPU benchmark's models, written out (the GPU machine has no network, and may lack transformers or
torchvision): GPT-2 124M (nanoGPT's layout) and ResNet-50 (torchvision's when it is installed, else the same
network written here).  Each comes with a training step on synthetic data."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "gpt2", "resnet50"]


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257, padded to a multiple of 64 as nanoGPT does
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c.n_embd), CausalSelfAttention(c)
        self.ln_2, self.mlp = nn.LayerNorm(c.n_embd), MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt2(device: torch.device, *, quick: bool, batch: int, seq: int, compile: bool) -> tuple[nn.Module, object, str]:
    """GPT-2 124M (quick: a 2-layer miniature) in bf16 autocast on synthetic tokens; (model, one training step,
    where the model came from)."""
    config = GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=64) if quick else GPTConfig()
    model = GPT(config).to(device)
    run = torch.compile(model) if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, config.vocab_size, (batch, min(seq, config.block_size) + 1), device=device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with autocast:
            loss = run(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, step, "written out (nanoGPT's layout, tests/perf/_gpu_models.py)"


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None if stride == 1 and inplanes == out else nn.Sequential(
            nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """torchvision's resnet50, layer for layer (3, 4, 6, 3 bottlenecks)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        layers, inplanes = [], 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stage = [Bottleneck(inplanes, planes, stride)] + [Bottleneck(planes * 4, planes, 1)
                                                              for _ in range(blocks - 1)]
            layers.append(nn.Sequential(*stage))
            inplanes = planes * 4
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(device: torch.device, *, quick: bool, batch: int, compile: bool) -> tuple[nn.Module, object, str]:
    """ResNet-50 on synthetic images (bf16 autocast and channels-last on CUDA; quick: 32x32 images);
    (model, one training step, where the model came from)."""
    try:
        from torchvision.models import resnet50 as tv_resnet50

        model, source = tv_resnet50(weights=None), "torchvision"
    except ImportError:
        model, source = ResNet50(), "written out (tests/perf/_gpu_models.py)"
    cuda = device.type == "cuda"
    model = model.to(device, memory_format=torch.channels_last if cuda else torch.contiguous_format)
    run = torch.compile(model) if compile else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    size = 32 if quick else 224
    images = torch.randn(batch, 3, size, size, device=device)
    if cuda:
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def step() -> None:
        with autocast:
            loss = F.cross_entropy(run(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, step, source
