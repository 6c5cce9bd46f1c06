"""Private training (DP-SGD): sampling, accounting, and epsilon in `fit`'s logs.

`model.make_private(...)` (on `GradientTrackingMixin`) clips and noises every step;
this package says how much privacy those steps spend.

Example:

```python
import keras_gradtrack as kgt

q, steps = 256 / len(x), 60 * len(x) // 256
sigma = kgt.privacy.compute_noise_multiplier(3.0, q, steps, delta=1e-5)
model.make_private(l2_norm_clip=1.0, noise_multiplier=sigma, expected_batch_size=q * len(x))
model.fit(kgt.privacy.poisson_batches(x, y, sampling_rate=q), epochs=60,
          callbacks=[kgt.privacy.PrivacyAccountant(delta=1e-5, sampling_rate=q)])
```
"""

from keras_gradtrack.engine.adaptive_clip import AdaptiveClip
from keras_gradtrack.privacy.accounting import compute_epsilon, compute_noise_multiplier
from keras_gradtrack.privacy.callbacks import PrivacyAccountant
from keras_gradtrack.privacy.sampling import poisson_batch_indices, poisson_batches

__all__ = [
    "AdaptiveClip",
    "PrivacyAccountant",
    "compute_epsilon",
    "compute_noise_multiplier",
    "poisson_batch_indices",
    "poisson_batches",
]
