"""Vector-Jacobian products over one-hot cotangents: rows of a Jacobian, chunk by chunk."""

import math

import tensorflow as tf

from keras_gradtrack.autodiff.checks import check_connected


def chunked_basis_vjps(tape, y, sources, axes, chunk_size):
    """`basis_vjps` for every index of `axes`, vectorized `chunk_size` at a time."""
    num_rows = math.prod(y.shape[axis] for axis in axes)
    chunk_size = num_rows if chunk_size is None else min(chunk_size, num_rows)
    num_chunks = -(-num_rows // chunk_size)
    flat_sources = tf.nest.flatten(sources)
    chunks = _map_fn(
        lambda start: basis_vjps(
            tape, y, flat_sources, axes, start + tf.range(chunk_size), "x", True
        ),
        tf.range(num_chunks) * chunk_size,
        fn_output_signature=[tf.TensorSpec((chunk_size, *s.shape), s.dtype) for s in flat_sources],
        parallel_iterations=1,  # One chunk in flight bounds the memory.
    )
    rows = [
        tf.reshape(chunk, tf.concat([[num_chunks * chunk_size], tf.shape(source)], 0))[:num_rows]
        for chunk, source in zip(chunks, flat_sources)
    ]
    return tf.nest.pack_sequence_as(sources, rows)


def basis_vjps(tape, y, sources, axes, indices, sources_name, vectorized):
    """Stacks `d sum(y[..., i, ...]) / d sources` for each `i` of `indices`.

    `i` indexes the elements of `y` along `axes` (flattened in row-major order);
    the sum runs over the other axes. Indices past the end give zeros (computed
    by the vectorized map, skipped by the sequential one).
    """
    sizes = [y.shape[axis] if axis in axes else 1 for axis in range(y.shape.rank)]
    if None in sizes:
        raise ValueError(f"The output axes {axes} must have static sizes. Received: {y.shape}")
    num_rows = math.prod(sizes)

    def vjp_of_basis_cotangent(index):
        one_hot = tf.one_hot(index, num_rows, dtype=y.dtype)
        cotangent = tf.broadcast_to(tf.reshape(one_hot, sizes), tf.shape(y))
        vjps = tape.gradient(y, sources, output_gradients=cotangent)
        check_connected(sources, vjps, sources_name)
        return vjps

    if vectorized:
        return tf.vectorized_map(vjp_of_basis_cotangent, indices)

    def vjp_unless_past_the_end(index):
        zeros = [tf.zeros(s.shape, s.dtype) for s in sources]
        return tf.cond(index < num_rows, lambda: vjp_of_basis_cotangent(index), lambda: zeros)

    signature = [tf.TensorSpec(s.shape, s.dtype) for s in sources]
    return _map_fn(
        vjp_unless_past_the_end, indices, fn_output_signature=signature, parallel_iterations=1
    )


def _map_fn(fn, elems, **kwargs):
    """`tf.map_fn` that leaves the variable scope as it found it, even when `fn` raises.

    `tf.map_fn` sets a caching device on the current variable scope and resets it
    only on success; left set, it breaks every later `tf.distribute` strategy
    scope in the process ("Caching devices is not yet supported when eager
    execution is enabled").
    """
    scope = tf.compat.v1.get_variable_scope()
    caching_device = scope.caching_device
    try:
        return tf.map_fn(fn, elems, **kwargs)
    finally:
        scope.set_caching_device(caching_device)
