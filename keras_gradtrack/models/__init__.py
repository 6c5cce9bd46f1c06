"""The models: Keras models whose `fit` also computes per-example gradient statistics.

* `GradientTrackingMixin` (`trainer.py`): the training step, the tracked/untracked
  decision, `gradient_statistics`, `make_private`.
* `GradientTrackingModel`, `GradientTrackingSequential` (`model.py`): the mixin on
  `keras.Model` and `keras.Sequential`, registered for `keras.models.load_model`.
* `BatchNormalizationTracking` (`engine/batch_normalization_tracking.py`, shared
  with the JAX engine): the opt-in settings of BatchNormalization in training.
* `convert_to_group_normalization` (`convert.py`): a model with BatchNormalization
  replaced, for exact per-example statistics.

Example:

```python
from keras_gradtrack.models import GradientTrackingModel

model = GradientTrackingModel(inputs, outputs)
```
"""

from keras_gradtrack.engine.batch_normalization_tracking import BatchNormalizationTracking
from keras_gradtrack.models.convert import convert_to_group_normalization
from keras_gradtrack.models.model import GradientTrackingModel, GradientTrackingSequential
from keras_gradtrack.models.trainer import GradientTrackingMixin

__all__ = [
    "BatchNormalizationTracking",
    "GradientTrackingMixin",
    "GradientTrackingModel",
    "GradientTrackingSequential",
    "convert_to_group_normalization",
]
