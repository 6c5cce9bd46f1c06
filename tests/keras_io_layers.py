"""keras-io's layers that call a layer on values that do not depend on the batch, as
written there (no backend imports here: both backends' tests use them)."""

from __future__ import annotations

from typing import Any

from keras import layers, ops


class TokenAndPositionEmbedding(layers.Layer):
    """keras-io text_classification_with_transformer's embedding: a learned position
    table called on `ops.arange(maxlen)`."""

    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


class PatchEncoder(layers.Layer):
    """keras-io image_classification_with_vision_transformer's encoder: the position
    index has a leading axis of one, `(1, num_patches)`."""

    def __init__(self, num_patches: int, projection_dim: int) -> None:
        super().__init__()
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(input_dim=num_patches, output_dim=projection_dim)

    def call(self, patch: Any) -> Any:
        positions = ops.expand_dims(ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
        projected_patches = self.projection(patch)
        return projected_patches + self.position_embedding(positions)
