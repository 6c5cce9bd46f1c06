"""TensorFlow Privacy's DP-SGD on the digits task of `utility_task.py` (TensorFlow 2.15, Keras 2):
`DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=None)`
(every example its own microbatch) in `tf.keras` `fit` with **fixed shuffled batches** of
64 (22 a epoch, reshuffled each epoch): the optimizer takes the batches it is given and
divides the noisy sum by the batch's size. Epsilon from TensorFlow Privacy's
`compute_dp_sgd_privacy` (its RDP accountant on dp-accounting), which assumes Poisson
sampling at rate 64/1408 (the fixed batches are accounted as if Poisson-sampled); beside
it (`epsilon_other`) the PLD epsilon of `compute_dp_sgd_privacy_statement`, which also
states (`epsilon_once_per_epoch`) the epsilon for each example once per epoch in an
arbitrary order, without amplification by sampling.

Install (a virtualenv of its own; tensorflow-privacy 0.9.0 needs the pin):
    python3.11 -m venv /tmp/peers-tfp && /tmp/peers-tfp/bin/pip install tensorflow==2.15.1 tensorflow-privacy==0.9.0 scikit-learn
Run (from the project root; one JSON line per seed):
    /tmp/peers-tfp/bin/python benchmarks/peers_utility/tfprivacy_digits.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402
import tensorflow_privacy  # noqa: E402
import utility_task as common  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib  # noqa: E402
from tensorflow_privacy.privacy.optimizers.dp_optimizer_keras import (  # noqa: E402
    DPKerasSGDOptimizer,
)

absl_logging.set_verbosity(absl_logging.ERROR)  # compute_dp_sgd_privacy's deprecation note


def statement_epsilons(epochs: float, noise_multiplier: float) -> tuple[float, float]:
    """(Poisson, once per epoch) epsilon of `compute_dp_sgd_privacy_statement` with its PLD
    accountant (no microbatching: every example is its own microbatch)."""
    statement = compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy_statement(
        common.TRAIN,
        common.BATCH,
        epochs,
        noise_multiplier,
        common.DELTA,
        used_microbatching=False,
        accountant_type=compute_dp_sgd_privacy_lib.AccountantType.PLD,
    )
    poisson = re.search(r"Poisson sampling \(\*\):\s+([0-9.]+)", statement)
    once = re.search(r"once per epoch:\s+([0-9.]+)", statement)
    if poisson is None or once is None:
        raise ValueError(f"no epsilon in TensorFlow Privacy's statement:\n{statement}")
    return float(poisson.group(1)), float(once.group(1))


def run(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    x, y, x_test, y_test = common.digits()
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential(common.classifier_layers(tf.keras))
    optimizer = DPKerasSGDOptimizer(
        l2_norm_clip=common.CLIP,
        noise_multiplier=args.noise_multiplier,
        num_microbatches=None,
        learning_rate=args.learning_rate,
    )
    # The DP optimizers need the vector of per-example losses (their mean is the loss).
    loss = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE
    )
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=common.BATCH, epochs=args.epochs, shuffle=True, verbose=0)
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    steps = int(optimizer.iterations.numpy())
    assert len(history.epoch) * common.STEPS_PER_EPOCH == steps, steps
    epsilon, _ = compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy(
        n=len(x),
        batch_size=common.BATCH,
        noise_multiplier=args.noise_multiplier,
        epochs=steps / common.STEPS_PER_EPOCH,
        delta=common.DELTA,
    )
    pld, once_per_epoch = statement_epsilons(steps / common.STEPS_PER_EPOCH, args.noise_multiplier)
    return dict(
        tool="TF Privacy",
        accuracy=accuracy,
        epsilon=epsilon,
        steps=steps,
        seconds=seconds,
        accountant="RDP (compute_dp_sgd_privacy)",
        epsilon_other=pld,
        other_accountant="PLD",
        epsilon_once_per_epoch=once_per_epoch,
        sampling="fixed shuffled batches of 64 (accounted as Poisson)",
        version=f"tensorflow-privacy {tensorflow_privacy.__version__}, tensorflow {tf.__version__}",
    )


if __name__ == "__main__":
    common.main(__doc__.split("\n")[0], run)
