"""JAX/Flax tracker: ``from tandv.track.jax import track``.

See the README's "JAX/Flax tracking" section for use with Flax linen, Flax nnx and optax.
"""

from ._summary import DeviceSummary, summarize_jax, summarize_many_jax, to_vector
from ._tracker import JaxTracker, track

__all__ = [
    "track",
    "JaxTracker",
    "summarize_jax",
    "summarize_many_jax",
    "to_vector",
    "DeviceSummary",
]
