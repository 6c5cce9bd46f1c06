"""The tables of `overhead.py`: per-round figures to paired ratios, and the markdown report;
the step timer the other scripts share."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any

import keras
import tensorflow as tf
from zoo import ZOO

TIMED = ("plain", "tracked", "every_10", "tape_loop", "jacobian")


class StepTimes(keras.callbacks.Callback):
    """Wall time of each step of a `fit`, from its `on_train_batch_begin` to its
    `on_train_batch_end` (`times`, seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.times.append(time.perf_counter() - self._start)


def failure_text(error: Exception) -> str:
    traceback.print_exc(file=sys.stderr)
    if "ResourceExhausted" in type(error).__name__ or isinstance(error, MemoryError):
        return "out of memory"
    return f"error: {type(error).__name__}"


def timing_row(
    rounds: dict[str, list[dict[str, Any]]], failures: dict[str, str], steps: dict[str, int]
) -> dict[str, Any]:
    """Medians over rounds, and ratios to plain paired by round: the median over rounds
    of each round's figure over plain's in the same round (load drift cancels)."""
    plain = {entry["round"]: entry for entry in rounds.get("plain", [])}
    row: dict[str, Any] = {"steps": steps, "figures": {}, "ratios": {}}
    for variant, entries in rounds.items():
        if variant in failures or not entries:
            row["figures"][variant] = failures.get(variant, "no rounds")
            continue
        keys = [key for key in entries[0] if key != "round"]
        row["figures"][variant] = {k: statistics.median(e[k] for e in entries) for k in keys}
        row["ratios"][variant] = {
            key: statistics.median(e[key] / plain[e["round"]][key] for e in paired)
            for key in keys
            if (paired := [e for e in entries if e["round"] in plain])
        }
    return row


def device_description() -> str:
    """What TensorFlow runs on, as seen from inside a child."""
    gpus = tf.config.list_physical_devices("GPU")
    names = [tf.config.experimental.get_device_details(gpu).get("device_name", "?") for gpu in gpus]
    try:
        from tensorflow.python.util import _pywrap_util_port

        onednn = "on" if _pywrap_util_port.IsMklEnabled() else "off"
    except (ImportError, AttributeError):
        onednn = "unknown"
    return f"GPUs: {', '.join(names) or 'none'}; CPU oneDNN: {onednn}"


# The vector extensions TensorFlow's CPU kernels and oneDNN pick their code by, as
# /proc/cpuinfo names them and as a table shows them.
CPU_FEATURES = {
    "avx2": "AVX2",
    "fma": "FMA",
    "avx512f": "AVX-512F",
    "avx512_vnni": "AVX-512 VNNI",
    "avx512_bf16": "AVX-512 BF16",
    "amx_tile": "AMX",
}


def cpu_features_line() -> str:
    """The table header's line of the CPU's vector extensions and whether TensorFlow
    runs oneDNN: the convolution rules' kernels (and TensorFlow's own) depend on both.

    Example:
        `- CPU features: AVX2, FMA, AVX-512F (no AVX-512 VNNI, ...); oneDNN on
        (IsMklEnabled(), TF_ENABLE_ONEDNN_OPTS unset)`
    """
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next(
            (line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), []
        )
    present = [name for flag, name in CPU_FEATURES.items() if flag in flags]
    absent = [name for flag, name in CPU_FEATURES.items() if flag not in flags]
    from tensorflow.python.util import _pywrap_util_port

    onednn = "on" if _pywrap_util_port.IsMklEnabled() else "off"
    setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    flag_text = "unset" if setting is None else f"={setting}"
    missing = f" (no {', '.join(absent)})" if absent else ""
    return (
        f"- CPU features: {', '.join(present) or 'none of ' + ', '.join(absent)}{missing}; "
        f"oneDNN {onednn} (IsMklEnabled(), TF_ENABLE_ONEDNN_OPTS {flag_text})"
    )


def machine_lines(devices: str) -> list[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), "?")
    with open("/proc/meminfo") as meminfo:
        memory_gib = int(meminfo.readline().split()[1]) / 2**20
    packages = ("tensorflow", "keras", "keras-gradtrack", "numpy", "h5py")
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in packages)
    here = os.path.dirname(os.path.abspath(__file__))
    git = ["git", "-C", here, "describe", "--always", "--dirty"]
    commit = subprocess.run(git, capture_output=True, text=True).stdout.strip() or "unknown"
    return [
        f"- CPU: {cpu}, {len(os.sched_getaffinity(0))} cores usable "
        f"({os.cpu_count()} logical), {memory_gib:.0f} GiB RAM; {devices}",
        cpu_features_line(),
        f"- Python {platform.python_version()}, {versions}",
        f"- commit {commit}, {datetime.date.today().isoformat()}",
    ]


def number(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def figure(row: dict[str, Any], variant: str, key: str, scale: float = 1e3) -> str:
    found = row["figures"].get(variant, "-")
    if not isinstance(found, dict):
        return str(found)
    return number(found[key] * scale) if key in found else "-"


def ratio(row: dict[str, Any], variant: str, key: str) -> str:
    found = row["ratios"].get(variant, {}).get(key)
    return "-" if found is None else number(found) + "x"


def table_row(name: str, timing: dict[str, Any], memory: dict[Any, Any], baselines: bool) -> str:
    if "row" not in timing:
        return f"| {name} | {timing['failure']} |"
    row = timing["row"]
    cells = [
        name,
        figure(row, "plain", "wall"),
        figure(row, "tracked", "wall"),
        ratio(row, "tracked", "wall"),
        ratio(row, "tracked", "cpu"),
        ratio(row, "every_10", "wall"),
        ratio(row, "tracked", "short_fit"),
        f"{figure(row, 'plain', 'fixed')} / {figure(row, 'tracked', 'fixed')}",
    ]
    growth = []
    for variant in ("plain", "tracked"):
        measured = memory.get((name, variant), "-")
        growth.append(measured["growth"] if isinstance(measured, dict) else measured)
    cells += [number(growth[0]), number(growth[1])]
    both = all(isinstance(g, float) for g in growth)
    cells.append(number(growth[1] / growth[0]) + "x" if both and growth[0] > 0 else "-")
    if baselines:
        cells += [ratio(row, "tape_loop", "wall"), ratio(row, "jacobian", "wall")]
        for variant in ("tape_loop", "jacobian"):
            if not isinstance(row["figures"].get(variant), dict):
                cells[-2 if variant == "tape_loop" else -1] = str(row["figures"].get(variant))
    return "| " + " | ".join(cells) + " |"


def header(args: Any) -> str:
    columns = [
        "model",
        "plain ms/step",
        "tracked ms/step",
        "tracked / plain",
        "CPU time tracked / plain",
        "every-10 / plain",
        f"{8}-step fit tracked / plain",
        "fixed ms per fit, plain / tracked",
        f"memory MiB plain (B={args.memory_batch_size})",
        "memory MiB tracked",
        "memory tracked / plain",
    ]
    if args.baselines:
        columns += ["tape loop / plain", "jacobian / plain"]
    return "| " + " | ".join(columns) + " |\n|" + " --- |" * len(columns)


def render(
    args: Any,
    timings: dict[str, dict[str, Any]],
    memory: dict[Any, Any],
    load_before: float,
    load_after: float,
    minutes: float,
) -> str:
    devices = next((t["devices"] for t in timings.values() if "devices" in t), args.device)
    lines = ["# keras_gradtrack overhead benchmark", "", *machine_lines(devices)]
    lines += [
        f"- device flag `--device {args.device}`, oneDNN `{args.onednn}`; load average "
        f"{load_before:.1f} at start, {load_after:.1f} at end; {minutes:.1f} min",
        "",
        f"Timing at batch size {args.batch_size}: {args.rounds} interleaved rounds, each a "
        f"`fit` per variant of {2} dropped + up to {args.steps} timed steps (fewer for "
        "slow steps, see each model); per round the median step (every-10: the mean of "
        "whole windows of ten), then the median over rounds. Ratios are paired: the "
        "median over rounds of each round's figure over plain's in the same round. CPU "
        "time is the process's (all threads). The 8-step fit is a whole `fit` of 8 steps "
        "(its fixed cost plus its first 8 steps); the fixed cost of a fit is its wall time "
        "minus its steps. Memory: peak growth during a "
        f"{args.memory_steps}-step `fit` at batch size {args.memory_batch_size} over the "
        "memory in use just before it, each variant in a fresh process "
        + ("(peak RSS)." if args.device == "cpu" else "(the GPU allocator's peak)."),
        "",
        header(args),
    ]
    lines += [table_row(name, timing, memory, args.baselines) for name, timing in timings.items()]
    lines += ["", "## The models", ""]
    for name, timing in timings.items():
        steps = timing.get("row", {}).get("steps", {})
        lines += [
            f"### {name}: {ZOO[name].description}",
            "",
            f"{timing.get('params', '?')} parameters; jit_compile {timing.get('jit_compile', '?')}; "
            f"timed steps per round {steps}.",
            "",
            "```",
            timing.get("summary", "(no plan: the child failed)"),
            "```",
            "",
        ]
    return "\n".join(lines)


def memory_cell(measured: Any) -> str:
    """A memory figure: the median, and the runs' range when there were several."""
    if not isinstance(measured, dict):
        return str(measured)
    runs = measured.get("runs", [])
    spread = f" ({min(runs):.0f}-{max(runs):.0f})" if len(runs) > 1 else ""
    return number(measured["growth"]) + spread


def render_memory(
    args: Any, memory: dict[Any, Any], load_before: float, load_after: float, minutes: float
) -> str:
    """The memory table alone (`overhead.py --no-timing`)."""
    lines = ["# keras_gradtrack memory benchmark", "", *machine_lines(args.device)]
    lines += [
        f"- load average {load_before:.1f} at start, {load_after:.1f} at end; {minutes:.1f} min",
        "",
        f"Peak growth during a {args.memory_steps}-step `fit` at batch size "
        f"{args.memory_batch_size} over the memory in use just before it, each run in a "
        f"fresh process, {args.memory_repeats} run(s) per variant: median (range), MiB.",
        "",
        "| model | plain | tracked | tracked / plain (medians) |",
        "| --- | --- | --- | --- |",
    ]
    for name in args.models:
        plain, tracked = memory.get((name, "plain"), "-"), memory.get((name, "tracked"), "-")
        both = isinstance(plain, dict) and isinstance(tracked, dict) and plain["growth"] > 0
        ratio_text = number(tracked["growth"] / plain["growth"]) + "x" if both else "-"
        lines.append(f"| {name} | {memory_cell(plain)} | {memory_cell(tracked)} | {ratio_text} |")
    return "\n".join(lines)


def print_and_save(text: str, out: str | None) -> None:
    """Prints the report and, with `--out`, writes it there too (folders made)."""
    print(text, end="")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as file:
            file.write(text)
