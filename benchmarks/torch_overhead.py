"""Keras on PyTorch with keras_gradtrack beside Opacus on plain PyTorch, in one process.

For each model (`mlp`, `cnn`, `transformer` of `zoo.py`) and batch size, in a fresh
process: milliseconds per step of plain `keras.Model.fit` on the torch backend and of
`GradientTrackingModel.fit` with every step tracked (the default statistics, read to the
host in blocks as `HDF5GradientLogger` does, no file), tracked with the norms only
(`loss`, `grad_norm`, `layer_grad_norm`: what Opacus' ghost norms compute) and made private
(`make_private(l2_norm_clip=1.0, noise_multiplier=1.0)`, no logger: the DP-SGD step from
its one backward pass); and, on PyTorch twins of the same
models (same layers and widths), a plain PyTorch step, Opacus' ghost-clipping norms
(`GradSampleModuleFastGradientClipping`, one backward pass) and Opacus' DP step with
ghost clipping (its documented recipe: two backward passes). Each tool is reported over
its own framework's plain step; the variants alternate in rounds, medians reported.
Peak memory: each variant in a fresh process of its own, the growth of its peak RSS over
the baseline after building (5 steps at the batch size). Needs `pip install
opacus==1.6.0` for the Opacus columns (left out without it). Imports no TensorFlow.

```
python benchmarks/torch_overhead.py                          # B=128
python benchmarks/torch_overhead.py --batch-sizes 128,512 --out table.md
python benchmarks/torch_overhead.py --quick                  # smoke test
```
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep

from jax_overhead import NUM_BATCHES, BlockReader, timed_rounds

MESSAGE_PREFIX = "@@torch_overhead "
KERAS_VARIANTS = ("keras_plain", "keras_tracked", "keras_norms", "keras_private")
# The statistics of the norms-only variant: each example's loss and gradient norms.
NORMS_ONLY = ["loss", "grad_norm", "layer_grad_norm"]
OPACUS_VARIANTS = ("torch_plain", "opacus_ghost_norms", "opacus_ghost_dp")


def torch_twin(name: str) -> Any:
    """The PyTorch twin of `zoo.py`'s model (same layers, widths and parameters)."""
    import torch
    from torch import nn

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            from opacus.layers import DPMultiheadAttention  # Opacus' attention

            self.embedding = nn.Embedding(1000, 64)
            self.attention = DPMultiheadAttention(64, 4, batch_first=True)
            self.norm1 = nn.LayerNorm(64, eps=1e-3)
            self.ff1, self.ff2 = nn.Linear(64, 128), nn.Linear(128, 64)
            self.norm2 = nn.LayerNorm(64, eps=1e-3)
            self.out = nn.Linear(64, 2)

        def forward(self, ids: Any) -> Any:
            h = self.embedding(ids)
            a, _ = self.attention(h, h, h, need_weights=False)
            h = self.norm1(h + a)
            h = self.norm2(h + self.ff2(torch.relu(self.ff1(h))))
            return self.out(h.mean(1))

    if name == "mlp":
        return nn.Sequential(
            nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(24 * 24 * 32, 10),
        )
    return Transformer()


def torch_steps(name: str, x: Any, y: Any, batch_size: int) -> dict[str, Any]:
    """`{variant: run(steps) -> seconds}` for the plain PyTorch and Opacus variants."""
    import numpy as np
    import torch
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    from torch import nn

    if name == "cnn":
        x = np.moveaxis(x, -1, 1)  # PyTorch's NCHW
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where Keras puts its tensors
    inputs = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    targets = torch.from_numpy(np.asarray(y, np.int64)).to(device)
    batches = [
        (inputs[i : i + batch_size], targets[i : i + batch_size])
        for i in range(0, len(inputs), batch_size)
    ]
    torch.manual_seed(0)
    base = torch_twin(name).to(device)
    criterion = nn.CrossEntropyLoss()

    def looped(step: Any) -> Any:
        def run(epochs: int) -> float:
            begin = time.perf_counter()
            for _ in range(epochs):
                for batch in batches:
                    step(*batch)
            return time.perf_counter() - begin

        return run

    plain = copy.deepcopy(base)
    plain_optimizer = torch.optim.Adam(plain.parameters())

    def plain_step(xb: Any, yb: Any) -> None:
        plain_optimizer.zero_grad(set_to_none=True)
        criterion(plain(xb), yb).backward()
        plain_optimizer.step()

    ghost = GradSampleModuleFastGradientClipping(
        copy.deepcopy(base), loss_reduction="mean", use_ghost_clipping=True, max_grad_norm=1.0
    )
    ghost_optimizer = torch.optim.Adam(ghost.parameters())

    def ghost_step(xb: Any, yb: Any) -> None:
        ghost_optimizer.zero_grad(set_to_none=True)
        criterion(ghost(xb), yb).backward()
        ghost.get_norm_sample()
        ghost_optimizer.step()

    private = GradSampleModuleFastGradientClipping(
        copy.deepcopy(base), loss_reduction="mean", use_ghost_clipping=True, max_grad_norm=1.0
    )
    dp_optimizer = DPOptimizerFastGradientClipping(
        torch.optim.Adam(private.parameters()),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=batch_size,
        loss_reduction="mean",
    )
    dp_loss = DPLossFastGradientClipping(private, dp_optimizer, nn.CrossEntropyLoss(), "mean")

    def dp_step(xb: Any, yb: Any) -> None:
        dp_optimizer.zero_grad(set_to_none=True)
        dp_loss(private(xb), yb).backward()  # two backward passes inside
        dp_optimizer.step()

    return {
        "torch_plain": looped(plain_step),
        "opacus_ghost_norms": looped(ghost_step),
        "opacus_ghost_dp": looped(dp_step),
    }


def keras_fits(name: str, x: Any, y: Any, batch_size: int) -> dict[str, Any]:
    """`{variant: run(epochs) -> seconds}` for plain and tracked Keras `fit` on torch."""
    import keras
    from zoo import build_compiled

    import keras_gradtrack as kgt
    from keras_gradtrack import statistics as kgt_statistics

    if keras.backend.backend() != "torch":
        raise SystemExit(f"Expected KERAS_BACKEND=torch. Received: {keras.backend.backend()}")
    plain = build_compiled(name, keras.Model)
    tracked = build_compiled(name, kgt.GradientTrackingModel)
    tracked.set_weights(plain.get_weights())
    norms = build_compiled(name, kgt.GradientTrackingModel)
    norms.set_weights(plain.get_weights())
    private = build_compiled(name, kgt.GradientTrackingModel)
    private.set_weights(plain.get_weights())
    private.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=batch_size)
    statistics = {
        id(tracked): kgt_statistics.resolve(None),
        id(norms): kgt_statistics.resolve(NORMS_ONLY),
    }

    def fitted(model: Any) -> Any:
        def run(epochs: int) -> float:
            if id(model) in statistics:
                reader = BlockReader()
                model.gradient_tracking.subscribe(
                    "bench", statistics[id(model)], 1, reader.consume, finish=reader.read
                )
            begin = time.perf_counter()
            model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
            return time.perf_counter() - begin

        return run

    keras_fits.paths = [t.path for t in tracked.gradient_tracking_plan()]  # type: ignore[attr-defined]
    return {
        "keras_plain": fitted(plain),
        "keras_tracked": fitted(tracked),
        "keras_norms": fitted(norms),
        "keras_private": fitted(private),
    }


def has_opacus() -> bool:
    try:
        import opacus  # noqa: F401
    except ImportError:
        return False
    return True


def runners(name: str, batch_size: int, variants: tuple[str, ...]) -> dict[str, Any]:
    import torch
    from zoo import synthetic_batches

    torch.set_num_threads(2)
    x, y = synthetic_batches(name, batch_size, NUM_BATCHES)
    found: dict[str, Any] = {}
    if any(v in KERAS_VARIANTS for v in variants):
        found.update(keras_fits(name, x, y, batch_size))
    if any(v in OPACUS_VARIANTS for v in variants):
        found.update(torch_steps(name, x, y, batch_size))
    return {v: found[v] for v in variants}


def timing_child(name: str, batch_size: int, rounds: int, seconds: float) -> dict[str, Any]:
    variants = KERAS_VARIANTS + (OPACUS_VARIANTS if has_opacus() else ())
    runs = runners(name, batch_size, variants)
    for run in runs.values():
        run(1)  # warm
    ms = timed_rounds(runs, lambda run, epochs: run(epochs), rounds, seconds)
    return {
        "model": name,
        "batch_size": batch_size,
        **{f"{variant}_ms": value for variant, value in ms.items()},
        "paths": keras_fits.paths,  # type: ignore[attr-defined]
        "tensorflow_imported": "tensorflow" in sys.modules,
    }


def peak_memory_mib() -> float:
    """The GPU allocator's peak (on a GPU), or the process's peak RSS."""
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated()) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_child(name: str, batch_size: int, variant: str) -> dict[str, Any]:
    run = runners(name, batch_size, (variant,))[variant]
    before = peak_memory_mib()
    run(2)  # 2 epochs of NUM_BATCHES batches
    return {"variant": variant, "growth_mib": peak_memory_mib() - before}


def run_child(*arguments: str) -> dict[str, Any]:
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, __file__, *arguments], env=env, capture_output=True, text=True
    )
    for line in result.stdout.splitlines():
        if line.startswith(MESSAGE_PREFIX):
            return dict(json.loads(line[len(MESSAGE_PREFIX) :]))
    return {"error": result.stderr[-2000:]}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | B | Keras plain ms | tracked ms | tracked / plain | norms only ms "
        "| norms only / plain | private ms "
        "| private / plain | torch plain ms | Opacus ghost norms ms | norms / plain "
        "| Opacus ghost DP ms | DP / plain | memory growth MiB: Keras plain / tracked / "
        "norms only / private / torch plain / ghost norms / ghost DP |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | --- |",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['batch_size']} | failed |" + " |" * 13)
            continue

        def ms(variant: str, row: dict[str, Any] = row) -> str:
            value = row.get(f"{variant}_ms")
            return "-" if value is None else f"{value:.2f}"

        def ratio(variant: str, plain: str, row: dict[str, Any] = row) -> str:
            a, b = row.get(f"{variant}_ms"), row.get(f"{plain}_ms")
            return "-" if a is None or b is None else f"{a / b:.2f}x"

        memory = " / ".join(
            "-" if row.get("memory", {}).get(v) is None else f"{row['memory'][v]:.0f}"
            for v in (*KERAS_VARIANTS, *OPACUS_VARIANTS)
        )
        lines.append(
            f"| {row['model']} | {row['batch_size']} | {ms('keras_plain')} "
            f"| {ms('keras_tracked')} | {ratio('keras_tracked', 'keras_plain')} "
            f"| {ms('keras_norms')} | {ratio('keras_norms', 'keras_plain')} "
            f"| {ms('keras_private')} | {ratio('keras_private', 'keras_plain')} "
            f"| {ms('torch_plain')} | {ms('opacus_ghost_norms')} "
            f"| {ratio('opacus_ghost_norms', 'torch_plain')} | {ms('opacus_ghost_dp')} "
            f"| {ratio('opacus_ghost_dp', 'torch_plain')} | {memory} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--batch-sizes", default="128")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="wall time per timed run")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    parser.add_argument("--quick", action="store_true", help="one round of short runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.no_memory = 1, 0.2, True
    if args.child:
        name, batch_size = args.child.split(":")
        row = timing_child(name, int(batch_size), args.rounds, args.seconds)
        print(MESSAGE_PREFIX + json.dumps(row), flush=True)
        return
    if args.memory_child:
        name, batch_size, variant = args.memory_child.split(":")
        print(MESSAGE_PREFIX + json.dumps(memory_child(name, int(batch_size), variant)))
        return
    rows = []
    for name in args.models.split(","):
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            row = {
                "model": name,
                "batch_size": batch_size,
                **run_child(
                    "--child",
                    f"{name}:{batch_size}",
                    f"--rounds={args.rounds}",
                    f"--seconds={args.seconds}",
                ),
            }
            if not args.no_memory and "error" not in row:
                variants = [v for v in (*KERAS_VARIANTS, *OPACUS_VARIANTS) if f"{v}_ms" in row]
                row["memory"] = {
                    v: run_child("--memory-child", f"{name}:{batch_size}:{v}").get("growth_mib")
                    for v in variants
                }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, 2 threads"
    header = (
        f"PyTorch backend (torch {torch.__version__}, {device}); "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"rounds={args.rounds}, ~{args.seconds}s per timed run; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    text = f"{header}\n\n{table(rows)}\n"
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
