"""Models Inductor compiles, trained with and without each obs feature: the losses (to the bit) and Dynamo's frames.

The corpus holds what broke obs's graph taps or could: BatchNorm in training (its running statistics are buffers the
graph writes) and in eval mode, in-place ops, buffers, views, dropout, a residual block as timm builds it, a
transformer block as Hugging Face's GPT-2 builds it, and a ResNet-18 (timm's when it is installed).  CI runs a
slice (``tests/obs/runtime/test_compiled_corpus.py``); the whole matrix runs before a change to the graph taps
lands::

    python -m tests.obs.runtime.compiled_corpus --all     # every model x every feature: a table; exit 1 on a difference

One process compiles each model once per feature set, all of them with one Inductor cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import obs
from tests.training import train_compiled


class ConvBN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pool -> Linear: the model whose NaN check crashed Inductor's code."""

    def __init__(self, eval_bn: bool = False) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 4)
        self.eval_bn = eval_bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.bn.train(not self.eval_bn)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.bn(self.conv(x))), 1), 1))


class BasicBlock(nn.Module):
    """timm's ResNet BasicBlock: conv-bn-act twice, a 1x1 downsample when the shape changes, an in-place ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1, self.act1 = nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2, self.act2 = nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x)))))
        x += shortcut
        return self.act2(x)


class ResNet(nn.Module):
    """A ResNet of BasicBlocks (``layers=(2, 2, 2, 2)`` and ``width=64``: ResNet-18's shape)."""

    def __init__(self, layers: tuple[int, ...] = (1, 1), width: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        blocks, cin = [], width
        for i, n in enumerate(layers):
            cout = width * 2 ** i
            for j in range(n):
                blocks.append(BasicBlock(cin, cout, 2 if j == 0 and i > 0 else 1))
                cin = cout
        self.layers, self.fc = nn.Sequential(*blocks), nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class Attention(nn.Module):
    """GPT-2's attention as Hugging Face writes it: one projection split three ways, heads as views, a causal mask
    from a buffer, softmax, dropout."""

    def __init__(self, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.1), nn.Dropout(0.1)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq, dtype=torch.bool)).view(1, 1, seq, seq),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        w = q @ k.transpose(-1, -2) / (c // self.heads) ** 0.5
        w = torch.where(self.bias[:, :, :t, :t], w, torch.finfo(w.dtype).min)
        y = self.attn_dropout(w.softmax(-1)) @ v
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    """A pre-norm transformer block (LayerNorm, attention, GELU MLP, residuals)."""

    def __init__(self, dim: int = 16, heads: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(dim), Attention(dim, heads, seq), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim),
                                 nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Stateful(nn.Module):
    """In-place ops on activations, buffers the forward writes (a step count, a running mean), and views."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(16, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = h.relu_().mul(2.0)
        h.add_(1.0)
        with torch.no_grad():
            self.steps.add_(1)
            self.mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
        h = h.view(-1, 2, 16).transpose(0, 1).narrow(0, 0, 1).squeeze(0).unsqueeze(-1).flatten(1)
        return self.fc2(h - self.mean[:16])


class Slice(nn.Module):
    """CI's slice in one small graph: BatchNorm in training, an in-place ReLU on a residual sum, a LayerNorm, GELU,
    dropout, a buffer the forward writes, and views."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.steps.add_(1)
        h = self.bn(self.conv(x))
        h += x.mean(1, keepdim=True)
        h = self.act(h).flatten(2).transpose(1, 2)  # (batch, pixels, channels): a view
        h = self.drop(F.gelu(self.fc1(self.ln(h))))
        return self.fc2(h).mean(1)


def _resnet18() -> nn.Module:
    try:
        import timm  # type: ignore[import-not-found]
        return timm.create_model("resnet18", pretrained=False, num_classes=4)
    except ImportError:
        return ResNet((2, 2, 2, 2), 64)


def _image(g: torch.Generator, size: int = 12) -> torch.Tensor:
    return torch.randn(4, 3, size, size, generator=g)


#: model name -> (make the model, one step's inputs from a generator); the loss is the output's mean square
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple[torch.Tensor, ...]]]] = {
    "slice": (Slice, lambda g: (_image(g, 6),)),
    "convbn": (ConvBN, lambda g: (_image(g),)),
    "convbn_eval": (lambda: ConvBN(eval_bn=True), lambda g: (_image(g),)),
    "resnet": (ResNet, lambda g: (_image(g),)),
    "block": (Block, lambda g: (torch.randn(2, 8, 16, generator=g),)),
    "stateful": (Stateful, lambda g: (torch.randn(4, 16, generator=g),)),
    "resnet18": (_resnet18, lambda g: (torch.randn(2, 3, 32, 32, generator=g),)),
}


def compiled_run(model_name: str, steps: int = 3) -> dict[str, Any]:
    """Losses (as hex, every bit), Dynamo's frame and graph-break counters, and the seconds it took."""
    make, inputs = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    g = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    run = train_compiled(model, steps, lambda: inputs(g), lr=0.05, momentum=0.9)
    return {"losses": [loss.hex() for loss in run.losses], "frames": run.frames, "breaks": run.breaks,
            "seconds": round(time.perf_counter() - start, 1)}


def run(models: list[str], features: list[str], folder: Path) -> dict[str, dict[str, Any]]:
    """``{model: {"plain" | feature: compiled_run()}}``: each model without obs, then with each feature alone."""
    from tests.obs.runtime.test_compile_stays_on import FEATURES

    out: dict[str, dict[str, Any]] = {}
    for model in models:
        out[model] = {"plain": compiled_run(model)}
        print(f"corpus: {model} plain {out[model]['plain']['seconds']} s", file=sys.stderr, flush=True)
        for feature in features:
            where = folder / model / feature.replace(" ", "_").replace("=", "")
            where.mkdir(parents=True)
            FEATURES[feature](where)
            try:
                out[model][feature] = compiled_run(model)
            finally:
                obs.reset_context()
            print(f"corpus: {model} {feature} {out[model][feature]['seconds']} s", file=sys.stderr, flush=True)
    return out


def differences(results: dict[str, dict[str, Any]]) -> list[str]:
    """What a feature changed: ``model / feature: losses|frames|breaks``."""
    found = []
    for model, by_feature in results.items():
        plain = by_feature["plain"]
        for feature, got in by_feature.items():
            found += [f"{model} / {feature}: {key}" for key in ("losses", "frames", "breaks") if got[key] != plain[key]]
    return found


def main(argv: list[str] | None = None) -> int:
    from tests.obs.runtime.test_compile_stays_on import FEATURES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="slice", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--features", default="", help=f"comma-separated, of {', '.join(FEATURES)}")
    parser.add_argument("--all", action="store_true", help="every model but slice, every feature")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON document")
    args = parser.parse_args(argv)
    models = [m for m in MODELS if m != "slice"] if args.all else args.models.split(",")
    features = list(FEATURES) if args.all else [f for f in args.features.split(",") if f]
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="obs-corpus-") as folder:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(folder, "inductor"))
        results = run(models, features, Path(folder))
    if args.json:
        print(json.dumps(results))
    else:
        for model, by_feature in results.items():
            for feature, got in by_feature.items():
                same = all(got[k] == by_feature["plain"][k] for k in ("losses", "frames", "breaks"))
                same = "" if feature == "plain" else "same" if same else "DIFFERS"
                print(f"{model:12} {feature:22} {got['seconds']:7.1f} s  {' '.join(got['losses'])}  {same}")
    return 1 if differences(results) else 0


if __name__ == "__main__":
    sys.exit(main())
