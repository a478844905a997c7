"""Block verification (Sun et al., "Block Verification Accelerates Speculative
Decoding", ICLR 2025): the gamma drafts judged jointly instead of token by token.

Token-wise verification (Algorithm 1) stops at the first draft it rejects. Block
verification carries a weight along the drafted prefix,

    w_0 = 1,   w_i = min(1, w_{i-1} p_i(d_i) / q_i(d_i)),

the probability that the accepted prefix reaches d_i, given d_1..d_i. With the
block residual at every prefix,

    r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x))     (q_{g+1} = 0, so r_g = w_g),

the prefix d_1..d_i is kept, given that no longer prefix was, with probability

    h_i = r_i / (r_i + 1 - w_i),

scanned from i = g down to 1 (tau = the longest i whose uniform falls below h_i, 0 if
none), and the next token is drawn from the block residual at tau,
norm(max(0, w_tau p_{tau+1} - q_{tau+1})) (p_{g+1} itself after a full block).

Why it is exact: by induction from i = g, P(tau >= i | d_1..d_i) = w_i and
P(tau = i | d_1..d_i) = r_i. So the first i + 1 tokens of the output are
(d_1..d_i, y) with probability Q(d_1..d_i) [w_i q_{i+1}(y) min(1, ...) + max(0, w_i
p_{i+1}(y) - q_{i+1}(y))] + (earlier stops) = Q(d_1..d_i) w_i p_{i+1}(y) + ..., which
sums to the target's P(d_1..d_i, y) (tests/test_block_verification.py enumerates it).
It never accepts fewer drafts in expectation than the token-wise rule, and it equals
it at temperature 0 (one-hot p and q: w_i is 1 up to the first mismatch, then 0).

Shape letters: b batch, g gamma (drafted positions), v vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decoding.verification.rule import VerificationRule
from jaxspec.decoding.verification.token import Verdict, acceptance_rate, mask_unproposed
from jaxspec.sampling import gather_probs, sample_probs

RULE = VerificationRule(name='block', exact_only=True, adaptive_gamma=True,
                        multi_draft=False, verify_lengths=True)

_TINY = 1e-12  # Residual mass below this is rounding: no stop there, no sample from it.


def prefix_weights(draft_tokens, draft_probs, target_probs, num_drafts=None):
  """w [b, g+1]: w_0 = 1, w_i = min(1, w_{i-1} p_i(d_i) / q_i(d_i)); 0 past num_drafts [b].

  draft_tokens [b, g]; draft_probs [b, g, v]; target_probs [b, g+1, v].
  """
  gamma = draft_tokens.shape[1]
  p = gather_probs(target_probs[:, :gamma], draft_tokens)  # [b, g]
  q = gather_probs(draft_probs, draft_tokens)  # [b, g]
  ratio = jnp.where(q > 0, p / jnp.maximum(q, 1e-30), 0.0)  # A q = 0 draft is never drafted.
  if num_drafts is not None:
    ratio = jnp.where(jnp.arange(gamma)[None, :] < num_drafts[:, None], ratio, 0.0)
  weights = [jnp.ones_like(ratio[:, 0])]
  for i in range(gamma):  # gamma is static and small; a NaN ratio keeps w NaN onwards.
    weights.append(jnp.minimum(1.0, weights[-1] * ratio[:, i]))
  return jnp.stack(weights, axis=1)


def block_residuals(weights, draft_probs, target_probs, num_drafts=None):
  """Unnormalized block residuals max(0, w_i p_{i+1} - q_{i+1}) [b, g+1, v].

  weights [b, g+1] from prefix_weights; q is 0 at position g (the bonus position) and
  at positions a row did not propose.
  """
  draft_probs = mask_unproposed(draft_probs, num_drafts)
  padded_draft_probs = jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0)))  # [b, g+1, v]
  return jnp.maximum(weights[:, :, None] * target_probs - padded_draft_probs, 0.0)


def stop_probabilities(weights, residual_mass):
  """h [b, g]: P(tau = i | no longer prefix was kept) for i = 1..g.

  weights, residual_mass [b, g+1]. h_i = r_i / (r_i + 1 - w_i); 0 where r_i is
  rounding (or NaN, which never stops a block).
  """
  w, r = weights[:, 1:], residual_mass[:, 1:]
  h = r / jnp.maximum(r + 1.0 - w, 1e-30)
  return jnp.where(r > _TINY, jnp.minimum(h, 1.0), 0.0)


def block_verdict(rng, draft_tokens, draft_probs, target_probs, num_drafts=None) -> Verdict:
  """The block verification step (exact; no lenience).

  draft_tokens [b, g]; draft_probs [b, g, v] (q recorded at draft time); target_probs
  [b, g+1, v]; num_drafts [b] (optional, drafts past it are never accepted).
  Returns tau accepted drafts per row as num_accepted, the token drawn from the block
  residual at tau as next_token, h (stop_probabilities) as accept_probability, and
  the token-wise sum_x min(p, q) per drafted position as overlap (for alpha).
  """
  gamma = draft_tokens.shape[1]
  stop_rng, resample_rng = jax.random.split(rng)
  weights = prefix_weights(draft_tokens, draft_probs, target_probs, num_drafts)  # [b, g+1]
  residuals = block_residuals(weights, draft_probs, target_probs, num_drafts)  # [b, g+1, v]
  residual_mass = jnp.sum(residuals, axis=-1)  # [b, g+1]
  stop = stop_probabilities(weights, residual_mass)  # [b, g]
  uniform = jax.random.uniform(stop_rng, stop.shape)
  kept = uniform < stop  # [b, g]; h == 0 never keeps.
  positions = jnp.arange(1, gamma + 1)[None, :]
  num_accepted = jnp.max(jnp.where(kept, positions, 0), axis=1).astype(jnp.int32)  # [b]
  residual = jnp.take_along_axis(residuals, num_accepted[:, None, None], axis=1)[:, 0]
  mass = jnp.take_along_axis(residual_mass, num_accepted[:, None], axis=1)  # [b, 1]
  p_next = jnp.take_along_axis(target_probs, num_accepted[:, None, None], axis=1)[:, 0]
  # Only tau = 0 can be reached with no residual mass (p_1 == q_1): then y ~ p_1.
  next_probs = jnp.where(mass > _TINY, residual / jnp.maximum(mass, 1e-30), p_next)
  next_token = sample_probs(resample_rng, next_probs)
  overlap = acceptance_rate(target_probs[:, :gamma], draft_probs)
  return Verdict(num_accepted=num_accepted, next_token=next_token,
                 accept_probability=stop, overlap=overlap)
