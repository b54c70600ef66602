"""Throughput of Print-to-file and of reading print files, as ratios against the plain alternatives.

Run: python tests/perf/bench_print.py [--rounds 5] [--out bench-print.json]
Targets (issue "Print-to-file"): for >= 64K float32 elements, obs.Print writes at >= 60% of raw
byte writes and >= 3x the protobuf-library path; streaming parse >= 3x one whole-file
ParseFromString, with memory bounded by one record.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import obs  # noqa: E402
from printsink.reader import iter_print  # noqa: E402
from tests.printsink.print_pb2 import Print  # noqa: E402

SIZES = {"1K": (1 << 10, 20_000), "64K": (1 << 16, 400), "1M": (1 << 20, 25)}  # elements, calls per sample


class RawBytes:
    """The floor: the tensor's bytes, written with one os.write per call."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def __call__(self, tensor: torch.Tensor) -> None:
        os.write(self.fd, memoryview(tensor.numpy()).cast("B"))

    def close(self) -> None:
        os.close(self.fd)


class ProtobufLibrary:
    """MindSpore's way: build the Print message with the protobuf library, serialize, write."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "ab", buffering=0)

    def __call__(self, tensor: torch.Tensor) -> None:
        msg = Print()
        msg.value.add().desc = "t:"
        value = msg.value.add().tensor
        value.dims.extend(tensor.shape)
        value.tensor_type = "Float32"
        value.tensor_content = tensor.numpy().tobytes()
        self.f.write(msg.SerializeToString())

    def close(self) -> None:
        self.f.close()


class ObsPrint:
    """obs.Print with print_file_path set (closing, which fsyncs, is outside the timed calls)."""

    def __init__(self, path: str) -> None:
        obs.set_context(print_file_path=path)

    def __call__(self, tensor: torch.Tensor) -> None:
        obs.Print("t:", tensor)

    def close(self) -> None:
        obs.reset_context()


def write_obs(path: str, tensor: torch.Tensor, calls: int) -> None:
    sink = ObsPrint(path)
    for _ in range(calls):
        sink(tensor)
    sink.close()


def bench_writes(rounds: int, tmp: str) -> dict[str, dict[str, float]]:
    variants = {"raw bytes": RawBytes, "protobuf library": ProtobufLibrary, "obs.Print": ObsPrint}
    out = {}
    for label, (n, calls) in SIZES.items():
        tensor = torch.randn(n)
        mb = n * 4 * calls / 1e6
        samples: dict[str, list[float]] = {v: [] for v in variants}
        names = list(variants)
        for r in range(rounds + 1):
            for name in names[r % 3:] + names[:r % 3]:
                path = os.path.join(tmp, f"w-{r}-{name[:3]}.pb")
                sink = variants[name](path)
                t0 = time.perf_counter()
                for _ in range(calls):
                    sink(tensor)
                elapsed = time.perf_counter() - t0
                sink.close()
                os.remove(path)
                if r:  # round 0 warms up
                    samples[name].append(mb / elapsed)
        rates = {name: statistics.median(v) for name, v in samples.items()}
        out[label] = {f"{name} MB/s": round(rate, 1) for name, rate in rates.items()}
        out[label]["obs / raw"] = round(rates["obs.Print"] / rates["raw bytes"], 3)
        out[label]["obs / protobuf"] = round(rates["obs.Print"] / rates["protobuf library"], 3)
    return out


def parse_whole(path: str) -> int:
    with open(path, "rb") as f:
        msg = Print.FromString(f.read())
    total = 0
    for value in msg.value:
        if value.HasField("tensor"):
            total += np.frombuffer(value.tensor.tensor_content, np.float32).reshape(list(value.tensor.dims)).size
    return total


def parse_streaming(path: str) -> int:
    return sum(v.size for call in iter_print(path) for v in call.values if not isinstance(v, str))


def bench_parse(rounds: int, tmp: str) -> dict[str, dict[str, float]]:
    out = {}
    for label in ("64K", "1M"):
        n, _ = SIZES[label]
        path = os.path.join(tmp, f"parse-{label}.pb")
        calls = (100 << 20) // (n * 4)
        write_obs(path, torch.randn(n), calls)
        mb = os.path.getsize(path) / 1e6
        samples: dict[str, list[float]] = {"whole-file ParseFromString": [], "iter_print (streaming)": []}
        for r in range(rounds + 1):
            for name, fn in (("whole-file ParseFromString", parse_whole), ("iter_print (streaming)", parse_streaming)):
                t0 = time.perf_counter()
                assert fn(path) == n * calls
                if r:
                    samples[name].append(mb / (time.perf_counter() - t0))
        rates = {name: statistics.median(v) for name, v in samples.items()}
        tracemalloc.start()
        parse_streaming(path)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out[label] = {f"{name} MB/s": round(rate, 1) for name, rate in rates.items()}
        out[label].update({"file MB": round(mb, 1), "streaming / whole": round(
            rates["iter_print (streaming)"] / rates["whole-file ParseFromString"], 3),
            "streaming peak MB (tracemalloc)": round(peak / 1e6, 2), "record MB": round(n * 4 / 1e6, 2)})
        os.remove(path)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench-print.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="obs-bench-print-") as tmp:
        writes = bench_writes(args.rounds, tmp)
        parses = bench_parse(args.rounds, tmp)
    for title, table in (("write (tensor payload throughput, median)", writes), ("parse", parses)):
        print(title)
        for label, row in table.items():
            print(f"  {label:>4}  " + "  ".join(f"{k}: {v}" for k, v in row.items()))
    data = {"benchmark": "print", "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "rounds": args.rounds, "write": writes, "parse": parses}
    with open(args.out, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
