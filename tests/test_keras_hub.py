"""keras_hub models and layers at tiny random configurations (nothing downloaded).

A GPT-2 causal LM with LoRA (`backbone.enable_lora`) trains on the LoRA rules, exactly
and privately (the clipped mean against the oracle's).

GPT-2 (its token embedding tied to the output projection), BERT, ViT (a position
index and a class token made outside the step) and the encoder/decoder layers
with padding masks: exact against the oracle, and a tracked step equal to a
plain Keras step. The model classes are keras_hub's, with the mixin in front.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
from invariant import assert_tracked_step_equals_plain
from keras import layers
from oracle import assert_matches_oracle, oracle_statistics
from test_privacy import expected_update, private_update

import keras_gradtrack as kgt

keras_hub = pytest.importorskip("keras_hub")
pytestmark = [
    pytest.mark.slow,
    # keras_hub's TokenAndPositionEmbedding passes its masked input on to its position
    # table, and Keras warns of that in plain use too.
    pytest.mark.filterwarnings("ignore:.*does not support masking.*:UserWarning"),
]

rng = np.random.default_rng(3)
VOCABULARY, LENGTH, BATCH = 30, 8, 4
TINY = {"num_layers": 1, "num_heads": 2, "hidden_dim": 8, "intermediate_dim": 16}


def tracked(model_class: type) -> type:
    """`model_class` with gradient tracking, as a user writes it."""
    return type(f"Tracked{model_class.__name__}", (kgt.GradientTrackingMixin, model_class), {})


def sparse_categorical(model: Any) -> Any:
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return model


def exact_and_as_plain(model: Any, x: Any, y: Any, sample_weight: Any = None) -> None:
    assert kgt.check(model, x=x, y=y, sample_weight=sample_weight).refusals == []
    stats = model.gradient_statistics(x, y, sample_weight)
    assert_matches_oracle(stats, oracle_statistics(model, x, y, sample_weight))
    assert_tracked_step_equals_plain(model, x, y, sample_weight)


def token_batch() -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(1, VOCABULARY, (BATCH, LENGTH))
    padding = np.ones((BATCH, LENGTH), bool)
    padding[0, 5:] = False
    padding[2, 3:] = False
    return np.where(padding, ids, 0), padding


def test_gpt2_causal_lm_with_its_tied_embedding() -> None:
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, max_sequence_length=LENGTH, dropout=0.0, **TINY
    )
    model = sparse_categorical(tracked(keras_hub.models.GPT2CausalLM)(backbone, preprocessor=None))
    ids, padding = token_batch()
    x = {"token_ids": ids, "padding_mask": padding}
    # The causal LM's targets: the next token, weighted by the padding mask.
    exact_and_as_plain(model, x, np.roll(ids, -1, axis=1), padding.astype("float32"))


def test_bert_text_classifier() -> None:
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, max_sequence_length=LENGTH, dropout=0.0, **TINY
    )
    model = sparse_categorical(
        tracked(keras_hub.models.BertTextClassifier)(
            backbone, num_classes=3, preprocessor=None, dropout=0.0
        )
    )
    ids, padding = token_batch()
    x = {"token_ids": ids, "padding_mask": padding, "segment_ids": np.zeros_like(ids)}
    exact_and_as_plain(model, x, np.array([0, 1, 2, 1]))


def test_vit_image_classifier_with_constants_made_in_build() -> None:
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(16, 16, 3),
        patch_size=8,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        mlp_dim=16,
        dropout_rate=0.0,
        attention_dropout=0.0,
    )
    model = sparse_categorical(
        tracked(keras_hub.models.ViTImageClassifier)(
            backbone, num_classes=3, preprocessor=None, dropout=0.0
        )
    )
    summary = model.gradient_tracking_summary(print_fn=lambda _: None)
    assert "0 refused" in summary
    images = rng.normal(size=(BATCH, 16, 16, 3)).astype("float32")
    exact_and_as_plain(model, images, np.array([0, 1, 2, 1]))


def test_token_and_position_embedding_mask_reaches_the_encoder_and_pooling() -> None:
    inputs = keras.Input((LENGTH,), dtype="int32")
    hidden = keras_hub.layers.TokenAndPositionEmbedding(VOCABULARY, LENGTH, 8, mask_zero=True)(
        inputs
    )
    hidden = keras_hub.layers.TransformerEncoder(16, 2)(hidden)
    outputs = layers.Dense(3)(layers.GlobalAveragePooling1D()(hidden))
    model = sparse_categorical(kgt.GradientTrackingModel(inputs, outputs))
    ids, _ = token_batch()
    exact_and_as_plain(model, ids, np.array([0, 1, 2, 1]))


def test_the_translator_with_encoder_and_decoder_masks_trains_as_plain_keras() -> None:
    """keras-io's English-to-Spanish translator, built with keras_hub layers. Its loss
    is masked by the decoder's padding: Keras divides the batch's sum by the count
    of unmasked positions in the batch, so `l_i` follows the reduction table (not a
    one-example forward, which would divide by example i's own count); the rows
    still sum to the batch gradient."""
    encoder_inputs = keras.Input((LENGTH,), dtype="int64", name="encoder_inputs")
    encoded = keras_hub.layers.TokenAndPositionEmbedding(VOCABULARY, LENGTH, 8, mask_zero=True)(
        encoder_inputs
    )
    encoded = keras_hub.layers.TransformerEncoder(16, 2)(encoded)
    decoder_inputs = keras.Input((LENGTH,), dtype="int64", name="decoder_inputs")
    decoded = keras_hub.layers.TokenAndPositionEmbedding(VOCABULARY, LENGTH, 8, mask_zero=True)(
        decoder_inputs
    )
    decoded = keras_hub.layers.TransformerDecoder(16, 2)(
        decoder_sequence=decoded, encoder_sequence=encoded
    )
    model = kgt.GradientTrackingModel(
        [encoder_inputs, decoder_inputs], layers.Dense(VOCABULARY)(decoded)
    )
    model.compile(
        optimizer="rmsprop",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    source, _ = token_batch()
    target, _ = token_batch()
    x = {"encoder_inputs": source, "decoder_inputs": target}
    y = rng.integers(0, VOCABULARY, (BATCH, LENGTH))
    assert kgt.check(model, x=x, y=y).refusals == []
    stats = model.gradient_statistics(x, y)
    np.testing.assert_allclose(
        np.mean(stats["grad_norm"] * stats["cosine"]), stats["batch_grad_norm"], rtol=1e-4
    )
    assert_tracked_step_equals_plain(model, x, y)


def lora_gpt2(model_class: type) -> Any:
    """A small GPT-2 causal LM with `backbone.enable_lora(4)`, its `b` factors drawn at
    random (no factor's gradient vanishes)."""
    keras.utils.set_random_seed(7)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=100,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=32,
        dropout=0.0,
    )
    backbone.enable_lora(4)
    # Its own generator: the same factors in any test order (the module's `rng` has
    # drawn a different number of values before this test in a shuffled run).
    factors = np.random.default_rng(5)
    for variable in backbone.trainable_variables:
        if variable.name == "lora_kernel_b":
            variable.assign(factors.normal(size=variable.shape) * 0.1)
    model = model_class(backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.SGD(1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return model


def test_gpt2_causal_lm_with_lora_is_on_rules_exact_and_private() -> None:
    model = lora_gpt2(tracked(keras_hub.models.GPT2CausalLM))
    # Its own generator: the same tokens in any test order (the module's `rng` has
    # drawn a different number of values before this test in a shuffled run).
    ids = np.random.default_rng(11).integers(1, 100, (BATCH, LENGTH))
    x, y = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}, np.roll(ids, -1, axis=1)
    model(x)
    summary = model.gradient_tracking_summary(print_fn=lambda _: None)
    assert "4 tracked layers, 0 on the fallback path, 0 refused" in summary
    assert summary.count("rule:lora_einsum_dense") == 4
    exact_and_as_plain(model, x, y)

    _, norms = expected_update(model, x, y, 1.0)
    clip = float(np.median(norms))  # some examples clipped, some not
    expected, _ = expected_update(model, x, y, clip)
    model.make_private(l2_norm_clip=clip, noise_multiplier=0.0)
    update = private_update(model, x, y)
    np.testing.assert_allclose(update, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
