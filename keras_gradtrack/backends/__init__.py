"""Backend engines other than TensorFlow's (which lives in `keras_gradtrack.engine`)."""
