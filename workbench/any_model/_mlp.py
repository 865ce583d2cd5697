"""A small MLP classifier for the teaching notebooks, with logical axis annotations."""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workbench._validate import check_int
from workbench.models._layers import MAX_DIM, Normal, check_dtype, param
from workbench._sharding.rules import constrain


class MLPClassifier(nnx.Module):
    """Dense ReLU layers then a linear read-out: (B, in_features) -> logits (B, n_classes).

    Weights name logical axes ``embed`` (inputs) and ``mlp`` (hidden units), so the same
    ``Rules`` presets used for the GPT shard it (``mlp="model"`` gives tensor parallelism).

    Example:
        >>> clf = MLPClassifier(784, (256, 256), 10, rngs=nnx.Rngs(0))
        >>> clf(jnp.ones((4, 784))).shape
        (4, 10)
    """

    def __init__(self, in_features: int, hidden: Sequence[int], n_classes: int, *,
                 rngs: nnx.Rngs, dtype: str = "float32") -> None:
        *sizes, n_classes = _check_sizes(in_features, hidden, n_classes)
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"MLPClassifier: rngs={rngs!r} is a {type(rngs).__name__}; give "
                            "flax's nnx.Rngs, e.g. rngs=nnx.Rngs(0)")
        check_dtype(dtype, "dtype", "MLPClassifier")
        keys = jax.random.split(rngs.params(), len(sizes))   # one per weight
        self.weights = nnx.List()
        self.biases = nnx.List()
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
            # input layer (embed, mlp); hidden->hidden (None, mlp): one mesh axis never
            # shards both dims of a weight.
            ax_in = "embed" if i == 0 else None
            init = Normal((2.0 / fan_in) ** 0.5)
            self.weights.append(param(keys[i], init, (fan_in, fan_out), (ax_in, "mlp"), dtype))
            self.biases.append(param(None, nnx.initializers.zeros, (fan_out,), ("mlp",), dtype))
        init = Normal(sizes[-1] ** -0.5)
        self.out = param(keys[-1], init, (sizes[-1], n_classes), ("mlp", None), dtype)
        self.out_bias = param(None, nnx.initializers.zeros, (n_classes,), (None,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)                                 # (B, in_features)
        for w, b in zip(self.weights, self.biases, strict=True):
            x = jax.nn.relu(x @ w[...] + b[...])                      # (B, hidden)
            x = constrain(x, ("batch", "mlp"), name="hidden")
        return x @ self.out[...] + self.out_bias[...]                 # (B, n_classes)


def _check_sizes(in_features: Any, hidden: Any, n_classes: Any) -> list[int]:
    """``[in_features, *hidden, n_classes]`` as ints, each from 1 to ``MAX_DIM``, or an
    error naming the argument."""
    where = "MLPClassifier: "
    if isinstance(hidden, np.ndarray) and hidden.ndim == 1:
        hidden = hidden.tolist()
    if isinstance(hidden, (str, bytes, Mapping)) or not isinstance(hidden, Sequence):
        raise TypeError(f"{where}hidden={hidden!r} is a {type(hidden).__name__}; give the "
                        "hidden layers' widths as a sequence of ints, e.g. hidden=(256, 256) "
                        "(or () for none)")
    return [check_int(in_features, "in_features", maximum=MAX_DIM, where=where),
            *(check_int(h, f"hidden[{i}]", maximum=MAX_DIM, where=where)
              for i, h in enumerate(hidden)),
            check_int(n_classes, "n_classes", maximum=MAX_DIM, where=where)]


def classifier_loss(model: MLPClassifier, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy of ``model(batch["x"])`` against int labels ``batch["y"]``."""
    import optax

    if not callable(model):
        raise TypeError(f"classifier_loss: model is a {type(model).__name__}, not callable; give "
                        "the classifier, e.g. an MLPClassifier: (B, ...) -> logits (B, classes)")
    want = "give a mapping {'x': inputs (B, ...), 'y': int labels (B,)}"
    if not isinstance(batch, Mapping):
        raise TypeError(f"classifier_loss: batch is a {type(batch).__name__}; {want}")
    if not {"x", "y"} <= set(batch):
        raise ValueError(f"classifier_loss: batch has keys {sorted(map(repr, batch))}, not "
                         f"'x' and 'y'; {want}")

    logits = model(batch["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))
