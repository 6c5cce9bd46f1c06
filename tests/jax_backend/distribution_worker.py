"""Tracked fits under a `keras.distribution` (`DataParallel`, `ModelParallel`) or on one device.

Run by `test_jax_distribution.py` in a process of its own (JAX reads
`XLA_FLAGS=--xla_force_host_platform_device_count=4` when it starts):

    python distribution_worker.py MODE OUT

MODE is `one_device` (no distribution), `data_parallel` (each batch sharded across
the 4 devices) or `model_parallel` (a 2 x 2 mesh: each batch sharded across 2, the
layers' weights along their units across the other 2). For each model (`MODELS`: an
MLP and a sequence model) the fit writes its log to `OUT/<model>/log.h5`, and
`OUT/<model>/arrays.npz` holds the final weights and the statistics of
`gradient_statistics` on one batch. The last line printed is a JSON object, by
model: how many times the example-independence guard ran, over how many devices the
first kernel lies and whether it is sharded, and (under `DataParallel`, for the MLP)
the errors of a plain Keras fit and of a tracked fit whose last batch the devices do
not divide; for the MLP, the bounds and final weights of a private fit with adaptive
clipping.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import keras
import numpy as np

import keras_gradtrack as kgt
from keras_gradtrack.backends.jax import independence
from keras_gradtrack.backends.jax.distribution import on_host

MODELS = ("mlp", "sequence")
EXAMPLES, BATCH, EPOCHS = 72, 16, 2  # per epoch 4 batches of 16 and a short one of 8
RAGGED = 70  # a last batch of 6, which 4 devices do not divide


def data(name: str, examples: int = EXAMPLES) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    if name == "mlp":
        return rng.normal(size=(examples, 12)).astype("float32"), rng.integers(0, 3, examples)
    return rng.integers(0, 20, size=(examples, 5)), rng.integers(0, 3, (examples, 5))


def build(name: str, model_class: type = kgt.GradientTrackingModel) -> keras.Model:
    keras.utils.set_random_seed(1234)
    if name == "mlp":
        inputs = keras.Input((12,))
        hidden = keras.layers.Dense(16, activation="tanh", name="hidden")(inputs)
    else:  # a sequence model: Dense on (B, T, d)
        inputs = keras.Input((5,), dtype="int32")
        hidden = keras.layers.Embedding(20, 8, name="embed")(inputs)
        hidden = keras.layers.Dense(8, activation="relu", name="mix")(hidden)
    outputs = keras.layers.Dense(3, name="out")(hidden)
    model = model_class(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


GUARD_RUNS: list[str] = []  # one entry each time the example-independence guard runs


def counted(check: Any) -> Any:
    def counting(model: keras.Model, *args: Any, **kwargs: Any) -> Any:
        GUARD_RUNS.append(model.name)
        return check(model, *args, **kwargs)

    return counting


independence.find_example_mixing = counted(independence.find_example_mixing)


def ragged_fit_error(name: str, model_class: type, out: Path) -> str:
    """The error of a fit whose last batch the devices do not divide ("" if none)."""
    model = build(name, model_class)
    x, y = data(name, RAGGED)
    tracked = model_class is kgt.GradientTrackingModel
    callbacks = [kgt.HDF5GradientLogger(out / "ragged.h5", overwrite=True)] if tracked else []
    try:
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
    except Exception as error:  # reported to the test, which compares the two
        return f"{type(error).__name__}: {error}"
    return ""


def adaptive_fit(name: str) -> dict[str, Any]:
    """A private fit with adaptive clipping (no noise): each epoch's last bound, the
    bound reached and the final weights."""
    model = build(name)
    x, y = data(name, 64)
    rows = process_rows(64)
    x, y = x[rows], y[rows]
    clip = kgt.privacy.AdaptiveClip(0.5, 0.2)
    model.make_private(
        l2_norm_clip=0.5, noise_multiplier=0.0, expected_batch_size=BATCH, adaptive_clip=clip
    )
    history = model.fit(x, y, batch_size=local_batch(), epochs=3, shuffle=False, verbose=0)
    return {
        "bounds": history.history["dp_l2_norm_clip"],
        "bound": float(on_host(model.__dict__["_adaptive_clip_bound"].value)),
        "weights": [w.tolist() for w in host_weights(model)],
    }


def process_rows(examples: int) -> np.ndarray:
    """This process's rows (all of them in one process): of each global batch of `BATCH`
    in order, the process's equal part, so that the processes' batches of
    `local_batch()` form the global batches of one process's fit."""
    processes, index = jax.process_count(), jax.process_index()
    rows = []
    for start in range(0, examples, BATCH):
        part = min(BATCH, examples - start) // processes
        rows.extend(range(start + index * part, start + (index + 1) * part))
    return np.asarray(rows)


def local_batch() -> int:
    return BATCH // jax.process_count()


def host_weights(model: keras.Model) -> list[np.ndarray]:
    """The model's weights on the host (gathered from every process)."""
    return [on_host(v.value) for v in model.weights]


def run(name: str, mode: str, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    model = build(name)
    x, y = data(name)
    ids = np.arange(EXAMPLES, dtype=np.int64) + 1000
    rows = process_rows(EXAMPLES)
    x, y, ids = x[rows], y[rows], ids[rows]
    model.fit(
        {"x": x, "example_id": ids},
        y,
        batch_size=local_batch(),
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(out / "log.h5", overwrite=True)],
    )
    sharding = model.trainable_variables[0].value.sharding
    report: dict[str, Any] = {
        "guard_runs": GUARD_RUNS.count(model.name),
        "weight_devices": len(sharding.device_set),
        "weight_sharded": not sharding.is_fully_replicated,
    }
    first = local_batch()  # this process's part of the first global batch
    stats = model.gradient_statistics(x[:first], y[:first])
    weights = {f"weight_{i}": w for i, w in enumerate(host_weights(model))}
    if jax.process_index() == 0:
        np.savez(out / "arrays.npz", **weights, **{f"stat_{k}": v for k, v in stats.items()})
    if name == "mlp":
        report["adaptive"] = adaptive_fit(name)
    if mode == "data_parallel" and name == "mlp":
        report["plain_ragged"] = ragged_fit_error(name, keras.Model, out)
        report["tracked_ragged"] = ragged_fit_error(name, kgt.GradientTrackingModel, out)
    return report


def distribution(mode: str) -> keras.distribution.Distribution | None:
    if mode == "data_parallel":
        return keras.distribution.DataParallel(devices=jax.devices()[:4])
    if mode == "model_parallel":
        mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], jax.devices()[:4])
        layouts = keras.distribution.LayoutMap(mesh)
        layouts["hidden/kernel"] = layouts["mix/kernel"] = (None, "model")
        layouts["hidden/bias"] = layouts["mix/bias"] = ("model",)
        layouts["embed/embeddings"] = (None, "model")
        layouts["out/kernel"] = ("model", None)
        return keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")
    if mode == "processes":
        # Each process reads its own rows (`process_rows`): no sharding of the dataset.
        parallel = keras.distribution.DataParallel(devices=jax.devices())
        parallel.auto_shard_dataset = False
        return parallel
    assert mode == "one_device", mode
    return None


def main(mode: str, out: Path, process: str | None = None) -> None:
    if mode == "processes":
        # Two processes of 2 devices each; gloo carries the collectives between them.
        assert process is not None
        address, index = process.rsplit("/", 1)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        keras.distribution.initialize(address, num_processes=2, process_id=int(index))
    keras.distribution.set_distribution(distribution(mode))
    print(json.dumps({name: run(name, mode, out / name) for name in MODELS}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
