"""jax-privacy's DP-SGD on the digits task of `utility_task.py` (Keras 3 on JAX):
`jax_privacy.keras_api.make_private(model, DPKerasConfig(clipping_norm=1.0,
noise_multiplier=1.1, batch_size=64, poisson_sampling_in_fit=True,
rescale_to_unit_norm=False, ...))`: its `fit` draws Poisson batches at rate 64/1408
(`CyclicPoissonSampling` with one cycle, padded with masked examples to a multiple of 32)
and divides the noisy sum by the expected batch size 64. Epsilon from jax-privacy's
`DpsgdTrainingAccountant` with the accountant its Keras API uses (PLD, discretization
1e-3); its RDP accountant's epsilon is printed beside it (`epsilon_other`).

Install (a virtualenv of its own):
    python3.11 -m venv /tmp/peers-jaxp && /tmp/peers-jaxp/bin/pip install "jax[cpu]" keras==3.15.1 jax-privacy==2.0.0 dp-accounting scikit-learn
Run (from the project root; one JSON line per seed):
    /tmp/peers-jaxp/bin/python benchmarks/peers_utility/jaxprivacy_digits.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from importlib import metadata
from typing import Any

os.environ["KERAS_BACKEND"] = "jax"
warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import keras  # noqa: E402
import utility_task as common  # noqa: E402
from jax_privacy import keras_api  # noqa: E402
from jax_privacy.accounting import accountants, analysis  # noqa: E402


def epsilons(noise_multiplier: float, steps: int) -> tuple[float, float]:
    """(PLD as the Keras API accounts, RDP) epsilon of `steps` Poisson-sampled steps."""
    params = analysis.DpParams(
        noise_multipliers=noise_multiplier,
        batch_size=common.BATCH,
        num_samples=common.TRAIN,
        delta=common.DELTA,
    )
    pld = keras_api.DPKerasConfig._accountant.compute_epsilon(steps, params)
    rdp = analysis.DpsgdTrainingAccountant(
        dp_accountant_config=accountants.RdpAccountantConfig()
    ).compute_epsilon(steps, params)
    return float(pld), float(rdp)


def run(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    x, y, x_test, y_test = common.digits()
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(common.classifier_layers(keras))
    steps = args.epochs * common.STEPS_PER_EPOCH
    config = keras_api.DPKerasConfig(
        epsilon=1e6,  # a budget not to bind: the noise multiplier is given
        delta=common.DELTA,
        clipping_norm=common.CLIP,
        batch_size=common.BATCH,
        gradient_accumulation_steps=1,
        train_steps=steps,
        train_size=len(x),
        poisson_sampling_in_fit=True,
        noise_multiplier=args.noise_multiplier,
        rescale_to_unit_norm=False,
        seed=seed,
    )
    model = keras_api.make_private(model, config)
    model.compile(
        optimizer=keras.optimizers.SGD(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    start = time.perf_counter()
    model.fit(x, y, batch_size=common.BATCH, epochs=args.epochs, verbose=0)
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    taken = int(model.optimizer.iterations.numpy())
    epsilon, epsilon_rdp = epsilons(args.noise_multiplier, taken)
    return dict(
        tool="jax-privacy",
        accuracy=accuracy,
        epsilon=epsilon,
        steps=taken,
        seconds=seconds,
        accountant="PLD (jax-privacy DpsgdTrainingAccountant, as keras_api)",
        epsilon_other=epsilon_rdp,
        other_accountant="RDP",
        sampling="Poisson (keras_api, poisson_sampling_in_fit=True)",
        version=f"jax-privacy {metadata.version('jax-privacy')}, jax {jax.__version__}, "
        f"keras {keras.__version__}",
    )


if __name__ == "__main__":
    common.main(__doc__.split("\n")[0], run)
