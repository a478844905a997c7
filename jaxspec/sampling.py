"""Standardized sampling and the speculative accept/resample rule.

Every sampling method is cast as sampling from an adjusted distribution (paper 2.2):
`standardize` turns logits into probabilities after temperature, top-k and top-p,
and argmax (temperature <= MIN_TEMPERATURE) becomes a one-hot distribution. The
target's p and the drafter's q go through the same `standardize`, so the accept rule
below keeps the target's distribution exactly (paper Appendix A.1).

Shape letters: b batch, g gamma (drafted positions), v vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec import prng

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
      raise ValueError(f'temperature must be >= 0, got {self.temperature}')
    if self.top_k < 0:
      raise ValueError(f'top_k must be >= 0 (0 disables it), got {self.top_k}')
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f'top_p must be in (0, 1] (1 disables it), got {self.top_p}')

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


def residual_distribution(target_probs, draft_probs, lenience: float = 1.0):
  """norm(max(0, p - l*q)) [..., v]; falls back to p where that is all zero.

  The fallback only matters when rounding leaves no mass (p == q up to float error),
  where a rejection has probability ~0 anyway.
  """
  residual = jnp.maximum(target_probs - lenience * draft_probs, 0.0)
  total = jnp.sum(residual, axis=-1, keepdims=True)
  return jnp.where(total > 1e-12, residual / jnp.maximum(total, 1e-30), target_probs)


def acceptance_probability(target_probs, draft_probs, draft_tokens,
                           lenience: float = 1.0, raw_target_probs=None):
  """Probability [b, g] of accepting each drafted token.

  target_probs, draft_probs [b, g, v] are standardized; draft_tokens [b, g].
  Exact rule (lenience 1): min(1, p(x) / q(x)). With lenience l < 1 (paper A.5):
  min(1, p(x) / (l q(x))) when sampling, and, for argmax, accept when
  raw_p(x) >= l * max(raw_p), where raw_target_probs [b, g, v] is the softmax of
  the target's logits before standardization. Lenience changes the output.
  """
  p = gather_probs(target_probs, draft_tokens)
  q = gather_probs(draft_probs, draft_tokens)
  if raw_target_probs is not None and lenience < 1.0:
    raw_p = gather_probs(raw_target_probs, draft_tokens)
    return (raw_p >= lenience * jnp.max(raw_target_probs, axis=-1)).astype(jnp.float32)
  scaled_q = lenience * q
  return jnp.where(scaled_q <= p, 1.0, p / jnp.maximum(scaled_q, 1e-30))


def acceptance_rate(target_probs, draft_probs, lenience: float = 1.0, raw_target_probs=None):
  """beta [...] = sum_x q(x) accept(x), the probability a draft from q is accepted.

  target_probs, draft_probs [..., v]. sum_x min(p, q) exactly (Theorem 3.5);
  sum_x min(p / l, q) with lenience l when sampling; for lenient argmax the q-mass of
  tokens with raw_p(x) >= l * max(raw_p).
  """
  if raw_target_probs is not None and lenience < 1.0:
    accepted = raw_target_probs >= lenience * jnp.max(raw_target_probs, axis=-1, keepdims=True)
    return jnp.sum(jnp.where(accepted, draft_probs, 0.0), axis=-1)
  return jnp.sum(jnp.minimum(target_probs / lenience, draft_probs), axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Verdict:
  """Outcome of one speculative sampling step for each row."""
  num_accepted: jax.Array  # [b] int32 in 0..g, drafts accepted before the first rejection
  next_token: jax.Array  # [b] int32, residual sample at the rejection, or the bonus token
  accept_probability: jax.Array  # [b, g] float32, min(1, p/q) per drafted position
  # [b, g] float32, the acceptance rate beta = sum_x q(x) accept(x) per drafted position:
  # sum_x min(p, q) when exact (Theorem 3.5), sum_x min(p / l, q) with lenience (A.5).
  overlap: jax.Array


def mask_unproposed(draft_probs, num_drafts):
  """draft_probs [b, g, v] with q set to 0 at positions >= num_drafts [b] (None: all kept).

  A position the drafter did not propose behaves as a draft from q = 0: it cannot be
  accepted, and the residual max(0, p - 0) there is p itself, so a row with k < g
  drafts is Algorithm 1 with gamma = k (its bonus token comes from p_{k+1}).
  """
  if num_drafts is None:
    return draft_probs
  proposed = jnp.arange(draft_probs.shape[1])[None, :] < num_drafts[:, None]  # [b, g]
  return jnp.where(proposed[:, :, None], draft_probs, 0.0)


def speculative_verdict(rng, draft_tokens, draft_probs, target_probs,
                        lenience: float = 1.0, raw_target_probs=None,
                        num_drafts=None) -> Verdict:
  """Algorithm 1's accept/resample step.

  draft_tokens [b, g]; draft_probs [b, g, v] (q recorded at draft time);
  target_probs [b, g+1, v] (p at each drafted position plus the bonus position);
  num_drafts [b] (optional): row b proposed only its first num_drafts[b] drafts, the
  rest are never accepted.
  Returns n accepted drafts per row and the token that follows them: sampled from
  norm(max(0, p_{n+1} - q_{n+1})) after a rejection, from p_{k+1} if all k are accepted.
  """
  gamma = draft_tokens.shape[1]
  accept_rng, resample_rng = jax.random.split(rng)
  accept_prob = acceptance_probability(
      target_probs[:, :gamma], draft_probs, draft_tokens, lenience,
      None if raw_target_probs is None else raw_target_probs[:, :gamma])
  if num_drafts is not None:
    accept_prob = jnp.where(jnp.arange(gamma)[None, :] < num_drafts[:, None], accept_prob, 0.0)
    draft_probs = mask_unproposed(draft_probs, num_drafts)
  uniform = jax.random.uniform(accept_rng, accept_prob.shape)
  rejected = uniform >= accept_prob  # [b, g]; accept_prob == 1 never rejects.
  # n = index of the first rejection, or gamma if none.
  num_accepted = jnp.where(jnp.any(rejected, axis=1), jnp.argmax(rejected, axis=1), gamma)
  num_accepted = num_accepted.astype(jnp.int32)
  # p_{n+1}, and q_{n+1} padded with zeros at the bonus position (so p' = p there).
  padded_draft_probs = jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0)))  # [b, g+1, v]
  p_next = jnp.take_along_axis(target_probs, num_accepted[:, None, None], axis=1)[:, 0]
  q_next = jnp.take_along_axis(padded_draft_probs, num_accepted[:, None, None], axis=1)[:, 0]
  next_probs = residual_distribution(p_next, q_next, lenience)  # [b, v]
  next_token = sample_probs(resample_rng, next_probs)
  overlap = acceptance_rate(target_probs[:, :gamma], draft_probs, lenience,
                            None if raw_target_probs is None else raw_target_probs[:, :gamma])
  return Verdict(num_accepted=num_accepted, next_token=next_token,
                 accept_probability=accept_prob, overlap=overlap)


def _matching_verdict(draft_tokens, target_tokens, num_drafts):
  """Drafts accepted while they equal the target's own tokens: draft_tokens [b, g],
  target_tokens [b, g+1], num_drafts [b] or None -> (num_accepted [b], next_token [b],
  accept [b, g] bool)."""
  gamma = draft_tokens.shape[1]
  accept = draft_tokens == target_tokens[:, :gamma]  # [b, g]
  if num_drafts is not None:
    accept &= jnp.arange(gamma)[None, :] < num_drafts[:, None]
  num_accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)  # [b]
  next_token = jnp.take_along_axis(target_tokens, num_accepted[:, None], axis=1)[:, 0]
  return num_accepted, next_token, accept


def greedy_verdict(draft_tokens, draft_probs, target_logits, num_drafts=None) -> Verdict:
  """speculative_verdict at temperature 0 (lenience 1), from the target's argmax alone.

  draft_tokens [b, g]; draft_probs [b, g, v]; target_logits [b, g+1, v]; num_drafts [b]
  or None. With p one-hot at t = argmax, the accept probability min(1, p(x)/q(x)) is
  1 when x == t and 0 otherwise, and after a rejection the residual max(0, p - q) is
  p itself: the outcome equals speculative_verdict's on standardize(...) for any q,
  without building [b, g+1, v] one-hots, residuals or random draws.
  """
  gamma = draft_tokens.shape[1]
  target_tokens = argmax(target_logits)  # [b, g+1]
  num_accepted, next_token, accept = _matching_verdict(draft_tokens, target_tokens, num_drafts)
  # sum_x min(p, q) with p one-hot at t is q(t).
  overlap = gather_probs(mask_unproposed(draft_probs, num_drafts), target_tokens[:, :gamma])
  return Verdict(num_accepted=num_accepted, next_token=next_token,
                 accept_probability=accept.astype(jnp.float32), overlap=overlap)


def coupled_tokens(target_logits, noise, config: SamplingConfig):
  """The target's draws at every verified position under shared noise: target_logits
  [..., v] and Gumbel noise [..., v] (prng.gumbel of each position's key; None when
  greedy) -> tokens [...], argmax(adjusted logits + noise), i.e. sample_logits with
  that key, draw for draw (argmax when greedy)."""
  if config.is_greedy:
    return argmax(target_logits)
  return gumbel_max(noise, adjusted_logits(target_logits, config))


def coupled_verdict(draft_tokens, target_tokens, num_drafts=None) -> Verdict:
  """Coupled verification: drafts [b, g] accepted while they equal the target's own
  draws target_tokens [b, g+1] at the same positions (coupled_tokens, the drafter
  having drawn each draft with the same position's noise); the next token is the
  target's draw after them. Every committed token is the target's draw with its
  position's noise, so the output is the baseline's for the same keys, token for token,
  whatever the drafts. num_drafts [b] or None. accept_probability and overlap are the
  0/1 agreement of each drafted position."""
  num_accepted, next_token, accept = _matching_verdict(draft_tokens, target_tokens, num_drafts)
  agreement = accept.astype(jnp.float32)
  return Verdict(num_accepted=num_accepted, next_token=next_token,
                 accept_probability=agreement, overlap=agreement)
