"""What tracking and private training cost on a causal LM with LoRA, beside its plain step.

A small GPT-2 causal LM of keras_hub (random weights, nothing downloaded) with
`backbone.enable_lora(4)`: only the query and value projections' LoRA factors and
biases train. For each batch size and sequence length: the median wall-clock time per
step of plain `fit`, of a tracked `fit` (every step; the default statistics, and the
norms-only ones), and of a private `fit` (`make_private`), timed in interleaved rounds
in one process; with `--fallback`, the tracked and private steps again with the LoRA
rules switched off (the exact per-layer fallback every LoRA layer took before them).
Prints a markdown table of the ratios to the plain step.

```
python benchmarks/lora.py                                    # B 8, 32 x T 32, 128
python benchmarks/lora.py --fallback                         # + the fallback's steps
python benchmarks/lora.py --batch-sizes 8 --lengths 32 --rounds 2 --steps 3   # smoke test
```
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from typing import Any
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np
import tensorflow as tf
from report import StepTimes

import keras_gradtrack as kgt
from keras_gradtrack import rules
from keras_gradtrack import statistics as kgt_statistics

WARMUP_STEPS = 2  # dropped at the start of every timed `fit`
VOCABULARY = 100
NORMS_ONLY = ["loss", "grad_norm", "layer_grad_norm"]
VARIANTS = ("plain", "tracked", "norms_only", "private")
FALLBACK_VARIANTS = ("fallback_tracked", "fallback_private")


def lora_causal_lm(model_class: type, length: int) -> Any:
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=length,
        dropout=0.0,
    )
    backbone.enable_lora(4)
    model = model_class(backbone, preprocessor=None)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return model


def without_lora_rules() -> Any:
    """The LoRA rules switched off: every LoRA layer on the exact fallback."""
    return mock.patch.dict(rules._CONFIGURATIONS, clear=True)


def build(variant: str, length: int) -> Any:
    import keras_hub

    if variant == "plain":
        return lora_causal_lm(keras_hub.models.GPT2CausalLM, length)
    tracked = type(
        "TrackedGPT2CausalLM", (kgt.GradientTrackingMixin, keras_hub.models.GPT2CausalLM), {}
    )
    model = lora_causal_lm(tracked, length)
    if variant.endswith("private"):
        model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)
    return model


class Subscriber(keras.callbacks.Callback):
    """Asks for the statistics (`names`; None: the default ones) of every step of a `fit`,
    and drops them: what a logger costs in the step, without its writing."""

    subscribes_to_gradients = True

    def __init__(self, names: list[str] | None) -> None:
        super().__init__()
        self.names = names
        self.reports = 0

    def on_train_begin(self, logs: Any = None) -> None:
        statistics_ = kgt_statistics.resolve(self.names)
        self.model.gradient_tracking.subscribe(self, statistics_, 1, self.count)

    def count(self, report: Any) -> None:
        self.reports += report.values is not None


def callbacks_of(variant: str) -> list[Any]:
    if variant in ("tracked", "fallback_tracked"):
        return [Subscriber(None)]
    if variant == "norms_only":
        return [Subscriber(NORMS_ONLY)]
    return []


def dataset_of(batch_size: int, length: int) -> Any:
    ids = np.random.default_rng(0).integers(1, VOCABULARY, (4 * batch_size, length))
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
    data = tf.data.Dataset.from_tensor_slices((x, np.roll(ids, -1, axis=1)))
    return data.batch(batch_size).repeat().prefetch(2)


def timed_fit(variant: str, model: Any, dataset: Any, steps: int) -> list[float]:
    timer = StepTimes()
    subscribers = callbacks_of(variant)
    switched = without_lora_rules() if variant.startswith("fallback") else contextlib.nullcontext()
    with switched:
        model.fit(
            dataset,
            steps_per_epoch=steps + WARMUP_STEPS,
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[*subscribers, timer],
        )
    for subscriber in subscribers:  # every step was tracked
        assert subscriber.reports == steps + WARMUP_STEPS, (variant, subscriber.reports)
    return timer.times[WARMUP_STEPS:]


def time_size(
    batch_size: int, length: int, variants: tuple[str, ...], rounds: int, steps: int
) -> dict[str, float]:
    """Median seconds per step of each variant, from interleaved rounds."""
    models = {variant: build(variant, length) for variant in variants}
    dataset = dataset_of(batch_size, length)
    for variant, model in models.items():  # traced before the rounds
        timed_fit(variant, model, dataset, 1)
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    for _ in range(rounds):
        for variant, model in models.items():
            times[variant] += timed_fit(variant, model, dataset, steps)
    return {variant: statistics.median(found) for variant, found in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--lengths", default="32,128")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round")
    parser.add_argument("--fallback", action="store_true", help="+ the fallback's steps")
    args = parser.parse_args()
    variants = VARIANTS + (FALLBACK_VARIANTS if args.fallback else ())
    header = ["B", "T", "plain ms", *(f"{v} / plain" for v in variants[1:])]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        for length in (int(t) for t in args.lengths.split(",")):
            found = time_size(batch_size, length, variants, args.rounds, args.steps)
            plain = found["plain"]
            ratios = [f"{found[v] / plain:.2f}x" for v in variants[1:]]
            print(f"| {batch_size} | {length} | {plain * 1e3:.1f} | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
