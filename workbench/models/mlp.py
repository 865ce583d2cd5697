"""A small MLP classifier for the teaching notebooks, with logical axis annotations."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from workbench.models.layers import param
from workbench.rules import constrain


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
        sizes = [in_features, *hidden]
        keys = jax.random.split(rngs.params(), len(hidden) + 1)
        self.weights = nnx.List()
        self.biases = nnx.List()
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
            # input layer (embed, mlp); hidden->hidden (None, mlp): one mesh axis never
            # shards both dims of a weight.
            ax_in = "embed" if i == 0 else None
            init = nnx.initializers.normal(stddev=(2.0 / fan_in) ** 0.5)
            self.weights.append(param(keys[i], init, (fan_in, fan_out), (ax_in, "mlp"), dtype))
            self.biases.append(param(None, nnx.initializers.zeros, (fan_out,), ("mlp",), dtype))
        init = nnx.initializers.normal(stddev=sizes[-1] ** -0.5)
        self.out = param(keys[-1], init, (sizes[-1], n_classes), ("mlp", None), dtype)
        self.out_bias = param(None, nnx.initializers.zeros, (n_classes,), (None,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)                                 # (B, in_features)
        for w, b in zip(self.weights, self.biases, strict=True):
            x = jax.nn.relu(x @ w[...] + b[...])                      # (B, hidden)
            x = constrain(x, ("batch", "mlp"), name="hidden")
        return x @ self.out[...] + self.out_bias[...]                 # (B, n_classes)


def classifier_loss(model: MLPClassifier, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy of ``model(batch["x"])`` against int labels ``batch["y"]``."""
    import optax

    logits = model(batch["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))
