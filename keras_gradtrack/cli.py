"""`keras-gradtrack`: read a gradient log from the command line.

```
keras-gradtrack summary LOG                  steps, examples, layers, range of every statistic
keras-gradtrack top LOG -k 20                most influential example ids (TracIn self-influence)
keras-gradtrack top LOG --by loss            highest mean loss first (any per-example statistic)
keras-gradtrack influence LOG --target 7     proponents and opponents of a logged target
keras-gradtrack plot LOG --out DIR           PNGs of the log (needs matplotlib)
keras-gradtrack export LOG --format csv      the tables as CSV or Parquet files
keras-gradtrack watch LOG --interval 2       a summary refreshed while training writes the log
keras-gradtrack tensorboard LOG --logdir tb/ TensorBoard event files of the log (needs tensorboard)
```

Errors (a missing file, a file that is not a log, a missing optional dependency)
print one line to stderr and exit with status 1; usage errors exit with 2. Output cut
short by its reader (`keras-gradtrack top LOG | head`) ends quietly with status 141,
as a process that SIGPIPE ends.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from keras_gradtrack import analysis
from keras_gradtrack.analysis import GradientLog
from keras_gradtrack.io.schema import TABLES
from keras_gradtrack.version import __version__

PROG = "keras-gradtrack"
RANKINGS = ("self-influence", "negative-cosine")
CLEAR_SCREEN = "\x1b[H\x1b[2J"
# The status of a process that SIGPIPE ends (128 + 13), as `yes | head` gives `yes`.
BROKEN_PIPE_STATUS = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status.

    Args:
        argv: the arguments after the program name (default: `sys.argv[1:]`).

    Returns:
        0 on success, 1 when the log cannot be read or written from.

    Example:

    ```python
    from keras_gradtrack import cli

    cli.main(["top", "run.h5", "-k", "20"])
    ```
    """
    args = _parser().parse_args(argv)
    try:
        args.run(args)
        # Written now, while a closed pipe is still an error this function handles.
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped reading (`| head`): nothing is wrong. Python's recipe: the
        # rest of the output goes to devnull, so that the flush at exit cannot fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE_STATUS
    except KeyboardInterrupt:
        return 0
    except (OSError, ValueError, KeyError, ImportError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)
        return 1
    return 0


def watch(
    path: str | Path,
    interval: float = 2.0,
    count: int | None = None,
    stream: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Prints the log's summary every `interval` seconds, picking up new rows each time.

    On a terminal the screen is cleared before each summary. Stop with Ctrl-C.

    Args:
        path: the log, typically one `HDF5GradientLogger` is writing.
        interval: seconds between refreshes (a non-negative number).
        count: stop after this many summaries (default: never).
        stream: where to print (default: standard output).
        sleep: the function that waits between refreshes.

    Raises:
        ValueError: for a negative or infinite `interval`.

    Example:

    ```python
    watch("run.h5", interval=5, count=3)
    ```
    """
    if not 0 <= interval < float("inf"):
        raise ValueError(
            f"Expected interval to be a non-negative number of seconds. Received: {interval=}"
        )
    stream = sys.stdout if stream is None else stream
    shown = 0
    with GradientLog(path) as log:
        while True:
            log.refresh()
            text = log.summary()
            if stream.isatty():
                stream.write(CLEAR_SCREEN)
            stream.write(
                f"{text}\n\n[{time.strftime('%H:%M:%S')}] refreshed every {interval:g} s; "
                "Ctrl-C stops\n"
            )
            stream.flush()
            shown += 1
            if count is not None and shown >= count:
                return
            sleep(interval)


def _summary(args: argparse.Namespace) -> None:
    with GradientLog(args.log) as log:
        print(log.summary())


def _top(args: argparse.Namespace) -> None:
    with GradientLog(args.log) as log:
        if args.by in RANKINGS:
            if args.by == "self-influence":
                scores = log.self_influence(learning_rate=args.learning_rate)
            else:
                scores = log.negative_cosine_frequency()
            scores = scores.bottom(args.k) if args.reverse else scores.top(args.k)
        elif args.by in log.rankable_statistics:
            scores = log.rank_by(args.by, args.k, reverse=args.reverse)
        else:
            available = [*RANKINGS, *log.rankable_statistics]
            close = difflib.get_close_matches(args.by, available, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"Cannot rank by {args.by!r}: it is neither a ranking nor a per-example "
                f"statistic of '{args.log}'.{hint} Available: {', '.join(available)}"
            )
    rows = [
        (rank, example_id, f"{score:.6g}", count)
        for rank, (example_id, score, count) in enumerate(
            zip(scores.example_id, scores.score, scores.rows), start=1
        )
    ]
    print(analysis.text_table(rows, header=("rank", "example_id", scores.name, "rows")))


def _influence(args: argparse.Namespace) -> None:
    with GradientLog(args.log) as log:
        influence = log.influence()
    targets = influence.target_ids if args.target is None else [args.target]
    sections = []
    for target in targets:
        for title, scores in (
            ("proponents", influence.proponents(int(target), args.k)),
            ("opponents", influence.opponents(int(target), args.k)),
        ):
            rows = [
                (rank, example_id, f"{score:.6g}", count)
                for rank, (example_id, score, count) in enumerate(
                    zip(scores.example_id, scores.score, scores.rows), start=1
                )
            ]
            table = analysis.text_table(rows, header=("rank", "example_id", "influence", "rows"))
            sections.append(f"target {target}, {title}:\n{table}")
    print("\n\n".join(sections))


def _plot(args: argparse.Namespace) -> None:
    from keras_gradtrack import plots

    out = args.out or Path(args.log).with_suffix("").as_posix() + "_plots"
    with GradientLog(args.log) as log:
        for path in plots.save_plots(log, out, dpi=args.dpi):
            print(path)


def _export(args: argparse.Namespace) -> None:
    out = Path(args.out) if args.out else Path(args.log).resolve().parent
    kinds = TABLES if args.table == "both" else (args.table,)
    stem = Path(args.log).with_suffix("").name
    with GradientLog(args.log) as log:
        out.mkdir(parents=True, exist_ok=True)
        for kind in kinds:
            path = out / f"{stem}.{kind}.{args.format}"
            writer = log.to_csv if args.format == "csv" else log.to_parquet
            print(writer(path, kind=kind))


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Standard error goes to devnull meanwhile (at the file descriptor: C++ writes it)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _import_tensorflow_quietly() -> None:
    """Imports TensorFlow without its start-up lines on stderr (its C++ logging before
    absl's is set up, the CPU features, no CUDA driver): not this command's output.
    `TF_CPP_MIN_LOG_LEVEL` (unless set) also quiets the lines of its first operations."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if "tensorflow" not in sys.modules:
        with _quiet_stderr():
            importlib.import_module("tensorflow")


def _tensorboard(args: argparse.Namespace) -> None:
    # Imports TensorFlow (tf.summary); the other commands never do.
    _import_tensorflow_quietly()
    from keras_gradtrack.callbacks.tensorboard_events import write_tensorboard

    logdir = args.logdir or Path(args.log).with_suffix("").as_posix() + "_tensorboard"
    written = write_tensorboard(
        args.log, logdir, histogram_every=args.histogram_every, buckets=args.buckets
    )
    print(written)
    print(f"open it with: tensorboard --logdir {written}")


def _watch(args: argparse.Namespace) -> None:
    watch(args.log, interval=args.interval, count=args.count)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Read a keras_gradtrack gradient log (an HDF5 file)."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[[argparse.Namespace], None], text: str) -> Any:
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("log", metavar="LOG", help="the .h5 log file")
        sub.set_defaults(run=run)
        return sub

    command("summary", _summary, "Steps, examples, layers, statistics and ranges.")
    top = command("top", _top, "The example ids ranked highest (most suspicious first).")
    top.add_argument("-k", type=_positive_int, default=20, help="how many (default 20)")
    top.add_argument(
        "--by",
        default="self-influence",
        metavar="RANKING",
        help="self-influence: sum over steps of lr x squared gradient norm (default); "
        "negative-cosine: fraction of steps against the batch gradient; or a per-example "
        "statistic of the log (loss, grad_norm, cosine, ...): its mean over the run, "
        "high first (low first for cosines)",
    )
    top.add_argument("--reverse", action="store_true", help="the other end of the ranking first")
    top.add_argument(
        "--learning-rate",
        type=_positive_number,
        default=None,
        help="constant learning rate for logs without /per_step/learning_rate",
    )
    influence = command(
        "influence",
        _influence,
        "The training examples that pushed the model toward a target (proponents: "
        "positive TracIn influence) and away from it (opponents), for a log written "
        "with targets.",
    )
    influence.add_argument(
        "--target", type=int, default=None, help="the target's id (default: every target)"
    )
    influence.add_argument("-k", type=_positive_int, default=10, help="how many (default 10)")
    plot = command("plot", _plot, "Write the plots of the log as PNG files.")
    plot.add_argument("--out", help="output directory (default: LOG without .h5 + '_plots')")
    plot.add_argument("--dpi", type=_positive_int, default=110, help="resolution (default 110)")
    export = command("export", _export, "Write the log's tables as CSV or Parquet files.")
    export.add_argument("--format", choices=["csv", "parquet"], default="csv")
    export.add_argument("--table", choices=[*TABLES, "both"], default="both")
    export.add_argument("--out", help="output directory (default: the log's directory)")
    board = command(
        "tensorboard",
        _tensorboard,
        "Write TensorBoard event files of the log: scalars per step, histograms of the "
        "per-example values (needs the tensorboard extra).",
    )
    board.add_argument(
        "--logdir", help="output directory (default: LOG without .h5 + '_tensorboard')"
    )
    board.add_argument(
        "--histogram-every",
        type=_positive_int,
        default=1,
        help="histograms for one logged step in every N (default 1)",
    )
    board.add_argument(
        "--buckets", type=_positive_int, default=30, help="buckets per histogram (default 30)"
    )
    live = command("watch", _watch, "Print the summary again as training writes the log.")
    live.add_argument(
        "--interval", type=_non_negative_number, default=2.0, help="seconds (default 2)"
    )
    live.add_argument("--count", type=_positive_int, default=None, help="stop after N summaries")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, received {text!r}")
    return value


def _positive_number(text: str) -> float:
    value = _non_negative_number(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, received {text!r}")
    return value


def _non_negative_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a non-negative number, received {text!r}")
    return value


if __name__ == "__main__":
    sys.exit(main())
