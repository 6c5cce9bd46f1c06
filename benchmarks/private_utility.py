"""Private training side by side on utility: keras_gradtrack (on TensorFlow, JAX and PyTorch),
TensorFlow Privacy, Opacus and jax-privacy on one task, model and set of DP-SGD
hyperparameters.

The task (`benchmarks/peers_utility/utility_task.py`): scikit-learn's 8x8 digits, 1408 to train
and 389 to test, standardized; an MLP 64-128-10 (ReLU, Glorot uniform, zero biases), mean
cross-entropy, plain SGD at learning rate 0.5; DP-SGD with clip 1.0, noise multiplier 1.1,
expected batch 64 (rate 1/22), 30 epochs of 22 steps, delta 1e-5. Each tool's driver
(`benchmarks/peers_utility/<tool>_digits.py`) runs in the tool's own virtualenv and prints
one JSON line per seed; this script only starts them and prints the table (accuracy mean
± std over seeds, each tool's own epsilon, seconds per epoch).

```
python benchmarks/private_utility.py --seeds 0,1,2,3,4
python benchmarks/private_utility.py --noise-multiplier 3 --seeds 0,1,2
python benchmarks/private_utility.py --tools keras_gradtrack,opacus --torch-python /venv/bin/python
python benchmarks/private_utility.py --tools keras_gradtrack,keras_gradtrack_jax,keras_gradtrack_torch
```

The peers' interpreters default to `/tmp/peers-torch`, `/tmp/peers-tfp` and
`/tmp/peers-jaxp` (`bin/python`), or `KGT_PEERS_TORCH`, `KGT_PEERS_TFP`, `KGT_PEERS_JAXP`
(each a virtualenv's folder); a tool whose interpreter is missing is skipped with a line
saying so. keras_gradtrack runs in this interpreter (`--kgt-python`), with the project
root on its path: `keras_gradtrack` with `KERAS_BACKEND=tensorflow`, `keras_gradtrack_jax`
(the same driver, the JAX engine's private step) with `KERAS_BACKEND=jax`,
`keras_gradtrack_torch` (the PyTorch engine's) with `KERAS_BACKEND=torch`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRIVERS = Path(__file__).resolve().parent / "peers_utility"
# tool: (driver, environment variable naming its virtualenv, default virtualenv)
TOOLS = {
    "keras_gradtrack": ("kgt_digits.py", None, None),
    "keras_gradtrack_jax": ("kgt_digits.py", None, None),
    "keras_gradtrack_torch": ("kgt_digits.py", None, None),
    "tf_privacy": ("tfprivacy_digits.py", "KGT_PEERS_TFP", "/tmp/peers-tfp"),
    "opacus": ("opacus_digits.py", "KGT_PEERS_TORCH", "/tmp/peers-torch"),
    "jax_privacy": ("jaxprivacy_digits.py", "KGT_PEERS_JAXP", "/tmp/peers-jaxp"),
}
FLAGS = {"tf_privacy": "tfp_python", "opacus": "torch_python", "jax_privacy": "jaxp_python"}
# keras_gradtrack's tools: the Keras backend each runs its driver on.
KGT_BACKENDS = {
    "keras_gradtrack": "tensorflow",
    "keras_gradtrack_jax": "jax",
    "keras_gradtrack_torch": "torch",
}


def interpreter(tool: str, args: argparse.Namespace) -> str:
    """The Python that runs `tool`'s driver: its flag, its variable's venv, or the default."""
    if tool in KGT_BACKENDS:
        return args.kgt_python
    flag = getattr(args, FLAGS[tool])
    if flag:
        return flag
    _, variable, default = TOOLS[tool]
    return str(Path(os.environ.get(variable, default)) / "bin" / "python")


def parse(lines: Iterable[str]) -> list[dict]:
    """The JSON objects among a driver's output lines (anything else is its chatter)."""
    rows = []
    for line in lines:
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if {"tool", "seed", "accuracy", "epsilon"} <= row.keys():
                rows.append(row)
    return rows


def spread(values: list[float], digits: int) -> str:
    """`mean ± std` (sample std over seeds), or the one value when all are equal."""
    if len(set(values)) == 1:
        return f"{values[0]:.{digits}f}"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {std:.{digits}f}"


def table(rows: list[dict]) -> str:
    """A markdown table: one line per tool, in the order the tools first appear."""
    lines = [
        "| tool | sampling | test accuracy (mean ± std) | seeds | epsilon (own accountant) "
        "| epsilon (other accountant) | steps | seconds per epoch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tool in dict.fromkeys(row["tool"] for row in rows):
        mine = [row for row in rows if row["tool"] == tool]
        accuracy = spread([row["accuracy"] for row in mine], 3)
        epsilon = spread([row["epsilon"] for row in mine], 2)
        if "accountant" in mine[0]:
            epsilon += f" ({mine[0]['accountant'].split()[0]})"
        other = "-"
        if "epsilon_other" in mine[0]:
            other = f"{spread([row['epsilon_other'] for row in mine], 2)} "
            other += f"({mine[0].get('other_accountant', '?')})"
        steps = spread([row["steps"] for row in mine], 0)
        per_epoch = [row["seconds"] / row.get("epochs", 1) for row in mine]
        lines.append(
            f"| {tool} | {mine[0].get('sampling', '?')} | {accuracy} | {len(mine)} | {epsilon} "
            f"| {other} | {steps} | {spread(per_epoch, 3)} |"
        )
    return "\n".join(lines)


def run_tool(tool: str, args: argparse.Namespace) -> list[dict]:
    """Run one tool's driver in its interpreter; its rows (none if it is missing or fails)."""
    python = interpreter(tool, args)
    if not Path(python).exists():
        print(f"# {tool}: skipped, no interpreter at {python}", flush=True)
        return []
    command = [python, str(DRIVERS / TOOLS[tool][0]), "--seeds", args.seeds]
    command += ["--epochs", str(args.epochs)] if args.epochs else []
    command += ["--noise-multiplier", str(args.noise_multiplier)] if args.noise_multiplier else []
    command += ["--learning-rate", str(args.learning_rate)] if args.learning_rate else []
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    if tool in KGT_BACKENDS:
        env["KERAS_BACKEND"] = KGT_BACKENDS[tool]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    rows = parse(done.stdout.splitlines())
    print(f"# {tool}: {len(rows)} seeds in {time.perf_counter() - start:.0f} s", flush=True)
    for row in rows:
        print(json.dumps(row), flush=True)
    if done.returncode != 0:
        print(f"# {tool}: exit status {done.returncode}; its last output:", flush=True)
        print("\n".join(done.stderr.splitlines()[-15:]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"of {', '.join(TOOLS)}")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--epochs", type=int, default=0, help="0: the task's 30")
    parser.add_argument("--noise-multiplier", type=float, default=0, help="0: the task's 1.1")
    parser.add_argument("--learning-rate", type=float, default=0, help="0: the task's 0.5")
    parser.add_argument("--kgt-python", default=sys.executable)
    parser.add_argument("--torch-python", default=None, help="Opacus' interpreter")
    parser.add_argument("--tfp-python", default=None, help="TensorFlow Privacy's interpreter")
    parser.add_argument("--jaxp-python", default=None, help="jax-privacy's interpreter")
    parser.add_argument("--out", default=None, help="also write the JSON lines to this file")
    args = parser.parse_args()
    unknown = [tool for tool in args.tools.split(",") if tool not in TOOLS]
    if unknown:
        parser.error(f"unknown tools {unknown}; the tools are {list(TOOLS)}")
    rows = []
    for tool in args.tools.split(","):
        rows += run_tool(tool, args)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    if rows:
        print()
        print(table(rows))
    try:
        load = os.getloadavg()
        print(f"\nload average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    except OSError:
        pass


if __name__ == "__main__":
    main()
