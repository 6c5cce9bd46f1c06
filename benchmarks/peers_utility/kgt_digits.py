"""keras_gradtrack's DP-SGD on the digits task of `utility_task.py` (Keras 3 on TensorFlow,
on JAX with `KERAS_BACKEND=jax`, tool `keras_gradtrack_jax`, or on PyTorch with
`KERAS_BACKEND=torch`, tool `keras_gradtrack_torch`: each engine's private step): `model.make_private(1.0, 1.1, expected_batch_size=64)`,
Poisson-sampled batches from `kgt.privacy.poisson_batches` (rate 1/22), plain SGD;
epsilon from `kgt.privacy.compute_epsilon` (dp-accounting's RDP accountant, its default)
for the steps taken; its PLD accountant's epsilon is printed beside it (`epsilon_other`).

Run (from the project root, in the project's virtualenv; one JSON line per seed):
    python benchmarks/peers_utility/kgt_digits.py --seeds 0,1,2
    KERAS_BACKEND=jax python benchmarks/peers_utility/kgt_digits.py --seeds 0,1,2
    KERAS_BACKEND=torch python benchmarks/peers_utility/kgt_digits.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras
import utility_task as common

import keras_gradtrack as kgt


def run(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    x, y, x_test, y_test = common.digits()
    keras.utils.set_random_seed(seed)
    model = kgt.GradientTrackingSequential(common.classifier_layers(keras))
    model.compile(
        optimizer=keras.optimizers.SGD(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    q = common.SAMPLING_RATE
    model.make_private(
        l2_norm_clip=common.CLIP,
        noise_multiplier=args.noise_multiplier,
        expected_batch_size=q * len(x),
    )
    batches = kgt.privacy.poisson_batches(
        x, y, sampling_rate=q, steps=common.STEPS_PER_EPOCH, seed=seed
    )
    start = time.perf_counter()
    model.fit(batches, epochs=args.epochs, verbose=0, shuffle=False)
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    steps = int(model.private_steps)
    epsilon = kgt.privacy.compute_epsilon(args.noise_multiplier, q, steps, common.DELTA)
    pld = kgt.privacy.compute_epsilon(args.noise_multiplier, q, steps, common.DELTA, "pld")
    backend = keras.backend.backend()
    return dict(
        tool="keras_gradtrack" if backend == "tensorflow" else f"keras_gradtrack_{backend}",
        accuracy=accuracy,
        epsilon=epsilon,
        steps=steps,
        seconds=seconds,
        accountant="RDP (kgt.privacy.compute_epsilon)",
        epsilon_other=pld,
        other_accountant="PLD",
        sampling="Poisson (kgt.privacy.poisson_batches)",
        version=f"keras_gradtrack {kgt.__version__}, keras {keras.__version__} on {backend}",
    )


if __name__ == "__main__":
    common.main(__doc__.split("\n")[0], run)
