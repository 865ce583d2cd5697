"""Models the tests share: the Flax NNX sharding guide's ``DotReluDot``."""
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P


class DotReluDot(nnx.Module):
    """The model of the Flax NNX sharding guide (annotations name mesh axes).

    With ``constrain`` (the guide's own model) the hidden activation is constrained to
    ``P("data", "model")``; without, the model names no mesh axis but in its parameters'
    annotations (for a search over meshes without a "data" axis).
    """

    def __init__(self, depth: int, rngs: nnx.Rngs, *, constrain: bool = True):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(depth, depth, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init_fn, (None, "model")))
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), out_sharding=("model", None))
        self.constrain = constrain

    def __call__(self, x):
        y = jax.nn.relu(self.dot1(x))
        if self.constrain:
            y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        return jnp.dot(y, self.w2[...])
