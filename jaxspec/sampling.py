"""Standardized sampling: adjusted distributions, argmax, draws.

Every sampling method is cast as sampling from an adjusted distribution (paper 2.2):
`standardize` turns logits into probabilities after temperature, top-k and top-p,
and argmax (temperature <= MIN_TEMPERATURE) becomes a one-hot distribution. The
target's p and the drafter's q go through the same `standardize`, so the accept rules
of jaxspec.decoding.verification keep the target's distribution exactly (paper
Appendix A.1).

Shape letters: b batch, g gamma (drafted positions), v vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec import prng
from jaxspec.errors import InvalidSetting

MIN_TEMPERATURE = 1e-4  # At or below this temperature sampling is argmax, as in T5X.
NEG_INF = -1e10


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How a token is drawn from logits. Hashable: a static argument of jit."""

  temperature: float = 0.0  # <= MIN_TEMPERATURE means argmax.
  top_k: int = 0  # Keep the k most likely tokens; 0 keeps all.
  top_p: float = 1.0  # Keep the smallest set with mass >= top_p; 1.0 keeps all.

  def __post_init__(self):
    if not self.temperature >= 0.0:
      raise InvalidSetting(f'temperature must be >= 0, got {self.temperature}')
    if self.top_k < 0:
      raise InvalidSetting(f'top_k must be >= 0 (0 disables it), got {self.top_k}')
    if not 0.0 < self.top_p <= 1.0:
      raise InvalidSetting(f'top_p must be in (0, 1] (1 disables it), got {self.top_p}')

  @property
  def is_greedy(self) -> bool:
    return self.temperature <= MIN_TEMPERATURE


def _top_k_mask(logits, k: int):
  """logits [..., v] -> same, with all but the k largest set to NEG_INF (ties kept)."""
  if k <= 0 or k >= logits.shape[-1]:
    return logits
  kth_largest = jax.lax.top_k(logits, k)[0][..., -1:]  # [..., 1]
  return jnp.where(logits < kth_largest, NEG_INF, logits)


def _top_p_mask(logits, top_p: float):
  """Keeps the most likely tokens until their mass reaches top_p (always >= 1 token)."""
  if top_p >= 1.0:
    return logits
  sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # [..., v] descending
  sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  # The cutoff is the smallest logit whose preceding mass is still below top_p.
  kept = mass_before < top_p
  cutoff = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits < cutoff, NEG_INF, logits)


def adjusted_logits(logits, config: SamplingConfig):
  """logits [..., v] -> float32 logits after temperature, top-k and top-p."""
  logits = logits.astype(jnp.float32) / max(config.temperature, MIN_TEMPERATURE)
  return _top_p_mask(_top_k_mask(logits, config.top_k), config.top_p)


def argmax(x):
  """jnp.argmax(x, axis=-1) as int32 [...]: the first index of the largest entry of
  x [..., v], or of the first NaN where a row has one.

  Computed as single-output reductions (the largest entry, then the first index holding
  it), which XLA:CPU vectorizes; its fused (value, index) reduction took ~36 us over an
  8000-way vocabulary row against ~7 us here, and ~220 us against ~70 us over the six
  rows of a verify step.
  """
  # Both reductions must read the same values: if x is an expression (logits + noise)
  # that the compiler fuses into each reduction and evaluates differently (rounding,
  # contraction), no entry may equal the max and the index would be v, out of range.
  # The barrier materializes x once; it costs nothing measurable ([10, 32128]: ~1 ms
  # either way, the draw's noise included).
  x = jax.lax.optimization_barrier(x)
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  nan = jnp.isnan(x)
  hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan,
                  x == jnp.max(x, axis=-1, keepdims=True))
  return jnp.min(jnp.where(hit, iota, x.shape[-1]), axis=-1)


def categorical(rng, logits):
  """jax.random.categorical(rng, logits) over the last axis, draw for draw: the same
  Gumbel noise from the key (`prng.gumbel`, its threefry rounds unrolled) added to
  logits [..., v], then the first largest entry by `argmax` instead of XLA:CPU's fused
  (value, index) reduction (~0.2 ms a draw over an 8000-way row in a draft step, most of
  a sampled step's work besides its matmuls)."""
  return gumbel_max(prng.gumbel(rng, logits.shape, logits.dtype), logits)


def gumbel_max(noise, logits):
  """The Gumbel-max draw: the first largest entry of noise + logits [..., v] -> [...].
  categorical and coupled_tokens both draw through it, so a draw with given noise is
  categorical's draw with that noise, bit for bit."""
  return argmax(noise + logits)


def standardize(logits, config: SamplingConfig):
  """logits [..., v] -> the distribution actually sampled from, probs [..., v] float32."""
  if config.is_greedy:
    return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(adjusted_logits(logits, config), axis=-1)


def nonfinite_logits(logits):
  """logits [..., v] -> [...] bool: the distribution cannot be sampled from.

  True where any logit is NaN or +inf, or where no logit is finite. -inf alone is a
  legal mask (a callback or top-k may remove tokens) and is not flagged.
  """
  return jnp.any(jnp.isnan(logits) | jnp.isposinf(logits), axis=-1) | ~jnp.any(
      jnp.isfinite(logits), axis=-1)


def sample_logits(rng, logits, config: SamplingConfig):
  """Draws tokens [...] from logits [..., v] under `config` (argmax when greedy)."""
  if config.is_greedy:
    return argmax(logits)
  return categorical(rng, adjusted_logits(logits, config))


def position_noise(keys, vocab_size: int):
  """keys [...] (raw uint32 [..., 2] or typed) -> Gumbel noise [..., vocab_size] float32,
  each key's as sample_logits adds it (prng.gumbel(key, (vocab_size,)))."""
  typed = jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
  batch_shape = keys.shape if typed else keys.shape[:-1]
  flat = keys.reshape((-1,) + keys.shape[len(batch_shape):])
  noise = jax.vmap(lambda key: prng.gumbel(key, (vocab_size,), jnp.float32))(flat)
  return noise.reshape(batch_shape + (vocab_size,))


def sample_probs(rng, probs):
  """Draws tokens [...] from probabilities [..., v] (zero entries are never drawn)."""
  safe_log = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
  return categorical(rng, safe_log)


def token_log_probs(logits, tokens, config: SamplingConfig, rescale: bool = True):
  """Log-probability [...] of `tokens` [...] under logits [..., v], as T5X reports it.

  rescale=True: under the adjusted distribution actually sampled from (0 for argmax);
  rescale=False: under the raw softmax of the logits.
  """
  if rescale and config.is_greedy:
    return jnp.zeros(tokens.shape, jnp.float32)
  source = adjusted_logits(logits, config) if rescale else logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(source, axis=-1)
  return jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]


def gather_probs(probs, tokens):
  """probs [..., v], tokens [...] -> probs[..., token] [...]."""
  return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
