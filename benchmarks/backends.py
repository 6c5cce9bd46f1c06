"""Both backends' overhead tables from one command: `overhead.py` on TensorFlow and
`jax_overhead.py` on JAX, each in a process of its own (Keras picks its backend when
imported), on the same models of `zoo.py` at the same batch size; prints both tables.

```
python benchmarks/backends.py                                 # mlp, cnn, transformer at B=128
python benchmarks/backends.py --models mlp --rounds 3 --out both.md
python benchmarks/backends.py --quick                         # smoke test
make bench-backends
```

The TensorFlow table is `overhead.py`'s timing columns (`--no-memory`: its memory
columns measure at another batch size); the JAX table has its own memory columns.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """`{backend: the benchmark's command line}`."""
    tensorflow = [str(HERE / "overhead.py"), "--models", args.models, "--no-memory"]
    jax = [str(HERE / "jax_overhead.py"), "--models", args.models]
    if args.quick:
        return {"tensorflow": [*tensorflow, "--quick"], "jax": [*jax, "--quick"]}
    tensorflow += ["--batch-size", str(args.batch_size), "--rounds", str(args.rounds)]
    jax += ["--batch-sizes", str(args.batch_size), "--rounds", str(args.rounds)]
    return {"tensorflow": tensorflow, "jax": jax}


def run(backend: str, command: list[str]) -> str:
    """Runs one backend's benchmark (its progress goes to stderr) and returns its table."""
    print(f"--- {backend}: {' '.join(command)}", file=sys.stderr, flush=True)
    environment = {**os.environ, "KERAS_BACKEND": backend}
    result = subprocess.run(
        [sys.executable, *command], env=environment, stdout=subprocess.PIPE, text=True
    )
    if result.returncode:
        raise SystemExit(f"the {backend} benchmark failed (exit {result.returncode})")
    return result.stdout


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn,transformer", help="of zoo.py")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="each benchmark's smoke test")
    parser.add_argument("--out", help="also write both tables (markdown) to this file")
    args = parser.parse_args(argv)
    started, load = time.perf_counter(), os.getloadavg()[0]
    tables = [
        f"## {backend}\n\n{run(backend, command).strip()}\n"
        for backend, command in commands(args).items()
    ]
    minutes = (time.perf_counter() - started) / 60
    text = "\n".join(tables)
    text += f"\nload average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end; "
    text += f"{minutes:.1f} min\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
