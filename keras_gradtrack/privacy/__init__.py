"""Private training (DP-SGD): sampling, accounting, and epsilon in `fit`'s logs.

`model.make_private(...)` (on `GradientTrackingMixin`) clips and noises every step;
this package says how much privacy those steps spend.

Example:

```python
import keras_gradtrack as kgt

q = 256 / len(x)
model.make_private(l2_norm_clip=1.0, target_epsilon=3.0, delta=1e-5, epochs=60,
                   sampling_rate=q, dataset_size=len(x))
model.fit(kgt.privacy.poisson_batches(x, y, sampling_rate=q), epochs=60,
          callbacks=[kgt.privacy.PrivacyAccountant(delta=1e-5)])
model.epsilon(1e-5)          # at most 3: every phase of model.privacy_history
```
"""

from keras_gradtrack.privacy.accounting import (
    compute_epsilon,
    compute_noise_multiplier,
    history_epsilon,
)
from keras_gradtrack.privacy.adaptive_clip import AdaptiveClip
from keras_gradtrack.privacy.budget import PrivacyBudget
from keras_gradtrack.privacy.callbacks import PrivacyAccountant
from keras_gradtrack.privacy.history import PrivacyPhase
from keras_gradtrack.privacy.sampling import poisson_batch_indices, poisson_batches

__all__ = [
    "AdaptiveClip",
    "PrivacyAccountant",
    "PrivacyBudget",
    "PrivacyPhase",
    "compute_epsilon",
    "compute_noise_multiplier",
    "history_epsilon",
    "poisson_batch_indices",
    "poisson_batches",
]
