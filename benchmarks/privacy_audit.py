"""Audits the private step empirically with one training run (Steinke, Nasr, Jagielski
2023) and prints a markdown table: variant, the accountant's epsilon, the empirical lower
bound, canaries, guesses, correct guesses.

Dirac canaries (`keras_gradtrack.privacy.audit.dirac_canary_audit`): canary j is the
one-hot input `c e_j` of a Dense layer with a loss linear in its output, so its gradient
is a Dirac of norm `c` on weight j; each is included with probability 1/2; full-batch
DP-SGD steps through `make_private`'s private step of the backend Keras runs on
(TensorFlow, or JAX with `KERAS_BACKEND=jax`); the score is weight j's change. The
variants: the real step (default and secure noise), the noise off
(`noise_multiplier=0`), and the clipping off (canaries of norm 100 C, the clipping
weights forced to 1: `privacy_audit.clipping_off`): the last two must break the
accountant's claim.

```
python benchmarks/privacy_audit.py                          # 10000 canaries, sigma 3, 4 steps
KERAS_BACKEND=jax python benchmarks/privacy_audit.py        # the JAX engine's step
python benchmarks/privacy_audit.py --canaries 1000 --per-side 100
```
"""

from __future__ import annotations

import argparse
import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras

from keras_gradtrack.privacy import compute_epsilon
from keras_gradtrack.privacy_audit import clipping_off, dirac_canary_audit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--canaries", type=int, default=10000)
    parser.add_argument("--per-side", type=int, default=500, help="guesses 'in' (and 'out')")
    parser.add_argument("--sigma", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    claimed = compute_epsilon(args.sigma, 1.0, args.steps, args.delta)
    common = dict(
        canaries=args.canaries, steps=args.steps, guesses_per_side=args.per_side,
        delta=args.delta, seed=args.seed,
    )  # fmt: skip
    variants = {
        "private step (default noise)": lambda: dirac_canary_audit(
            noise_multiplier=args.sigma, **common
        ),
        "private step (secure noise)": lambda: dirac_canary_audit(
            noise_multiplier=args.sigma, secure_noise=True, **common
        ),
        "noise off (sigma 0)": lambda: dirac_canary_audit(noise_multiplier=0.0, **common),
        "clipping off (canaries of norm 100 C)": lambda: unclipped_audit(args.sigma, common),
    }
    print(
        f"# {keras.backend.backend()} backend: "
        f"sigma {args.sigma}, {args.steps} full-batch steps, delta {args.delta}, "
        f"confidence 0.95, seed {args.seed}; accountant (RDP) for the claimed sigma"
    )
    print("| variant | accountant epsilon | empirical lower bound | canaries | guesses | correct |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, run in variants.items():
        result = run()
        print(
            f"| {name} | {claimed:.2f} | {result.epsilon_lower_bound:.2f} | "
            f"{result.canaries} | {result.guesses} | {result.correct} |",
            flush=True,
        )


def unclipped_audit(sigma: float, common: dict[str, Any]) -> Any:
    with clipping_off():
        return dirac_canary_audit(noise_multiplier=sigma, canary_norm=100.0, **common)


if __name__ == "__main__":
    main()
