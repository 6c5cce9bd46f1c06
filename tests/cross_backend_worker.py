"""Runs every case of tests/cross_backend_models.py on the backend of KERAS_BACKEND
(a subprocess of tests/test_cross_backend.py, once per backend).

    python tests/cross_backend_worker.py OUT [--weights-from DIR] [--cases a,b]

For each case, in OUT/<case>/: without `--weights-from`, the model's first weights are
saved (`initial.weights.h5`, or the whole model as `initial.keras` where the case says
so); with it, the model loads those files of DIR/<case>/ (written by the other backend)
instead. Then `fit` runs STEPS steps of BATCH examples in order with
`HDF5GradientLogger` (the default statistics) writing `log.h5`, and the weights after
them go to `final.weights.h5`. `result.json` says which file the weights came from
and, for a case that failed or was refused, the error.

Then, in OUT/autodiff/, every function of `keras_gradtrack.autodiff` on one Conv1D
model (`autodiff_model`, its weights saved or loaded as a case's) and fixed arrays:
`results.npz`, one array per result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from cross_backend_models import BATCH, CASES, WHOLE_MODEL, Run
from keras import ops

import keras_gradtrack as kgt
from keras_gradtrack import autodiff


def first_weights(name: str, run: Run, out: Path, weights_from: Path | None) -> str:
    """Saves the case's first weights to `out`, or loads the other backend's from
    `weights_from`; returns the file written or read."""
    whole = name in WHOLE_MODEL
    file = "initial.keras" if whole else "initial.weights.h5"
    if weights_from is None:
        if whole:
            # Built, so that the file holds the optimizer's variables it loads into.
            run.model.optimizer.build(run.model.trainable_variables)
            run.model.save(out / file)
        else:
            run.model.save_weights(out / file)
        return str(out / file)
    source = weights_from / name / file
    own = run.model.get_weights()
    if whole:
        run.model = keras.saving.load_model(source)
    else:
        run.model.load_weights(source)
    if all(np.array_equal(a, b) for a, b in zip(own, run.model.get_weights())):
        raise AssertionError(f"loading {source} left the model's own first weights")
    return str(source)


def run_case(name: str, out: Path, weights_from: Path | None) -> dict[str, str | None]:
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, str | None] = {"backend": keras.backend.backend(), "error": None}
    start = time.perf_counter()
    try:
        keras.backend.clear_session()
        keras.utils.set_random_seed(1234)
        run = CASES[name]()
        result["weights_from"] = first_weights(name, run, out, weights_from)
        logger = kgt.HDF5GradientLogger(out / "log.h5", **run.logger_options)
        run.model.fit(
            run.x,
            run.y,
            sample_weight=run.sample_weight,
            batch_size=BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[logger],
        )
        run.model.save_weights(out / "final.weights.h5")
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()
    result["seconds"] = f"{time.perf_counter() - start:.1f}"
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def autodiff_model() -> keras.Model:
    inputs = keras.Input((6, 3))
    hidden = keras.layers.Conv1D(4, 3, padding="same", activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(5)(keras.layers.Flatten()(hidden)))


def autodiff_results(out: Path, weights_from: Path | None) -> None:
    """Writes `out/results.npz`: each autodiff function's result on `autodiff_model`."""
    out.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(1234)
    model = autodiff_model()
    if weights_from is None:
        model.save_weights(out / "initial.weights.h5")
    else:
        model.load_weights(weights_from / "autodiff" / "initial.weights.h5")
    rng = np.random.default_rng(7)
    x = rng.normal(size=(4, 6, 3)).astype("float32")
    cotangent = rng.normal(size=(4, 5)).astype("float32")
    tangent = rng.normal(size=x.shape).astype("float32")
    variables = model.trainable_variables
    results = {
        "grad": autodiff.grad(model, x),
        "vjp": autodiff.vjp(model, x, cotangent)[1],
        "jvp": autodiff.jvp(model, x, tangent)[1],
        "batch_jacobian": autodiff.batch_jacobian(model, x, chunk_size=3),
        "jacobian": autodiff.jacobian(model, x[:2], chunk_size=4),
    }
    square = autodiff.grad(lambda _: ops.sum(model(x) ** 2), variables)
    results.update({f"grad_of_{v.path}": g for v, g in zip(variables, square)})
    chunks = list(autodiff.output_gradients(model, x, chunk_size=2))
    for position, variable in enumerate(variables):
        stacked = np.concatenate([ops.convert_to_numpy(g[position]) for _, g in chunks])
        results[f"output_gradients_of_{variable.path}"] = stacked
    arrays = {name.replace("/", "."): ops.convert_to_numpy(r) for name, r in results.items()}
    np.savez(out / "results.npz", **arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--weights-from", type=Path, default=None)
    parser.add_argument("--cases", default=",".join(CASES))
    arguments = parser.parse_args()
    for name in arguments.cases.split(","):
        result = run_case(name, arguments.out / name, arguments.weights_from)
        print(f"{name} ({result['seconds']} s): {result['error'] or 'ok'}", flush=True)
    autodiff_results(arguments.out / "autodiff", arguments.weights_from)


if __name__ == "__main__":
    main()
