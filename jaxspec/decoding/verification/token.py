"""Token-wise verification (Algorithm 1): drafts judged one by one, up to the first
rejection, then a draw from the residual norm(max(0, p - q)) or the bonus token.

The exact rule (lenience 1) keeps the target's distribution (paper Appendix A.1); a
lenience l < 1 (paper A.5) accepts more drafts and changes the output. At temperature 0
`greedy_verdict` decides from the target's argmax alone. Token-wise verification is the
one rule that takes lenience, adaptive gamma and multi-draft trees (RULE).

Shape letters: b batch, g gamma (drafted positions), v vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.verification.rule import VerificationRule
from jaxspec.sampling import argmax, gather_probs, sample_probs

RULE = VerificationRule(name='token', exact_only=False, adaptive_gamma=True,
                        multi_draft=True, verify_lengths=True)


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


def matching_verdict(draft_tokens, target_tokens, num_drafts):
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
  num_accepted, next_token, accept = matching_verdict(draft_tokens, target_tokens, num_drafts)
  # sum_x min(p, q) with p one-hot at t is q(t).
  overlap = gather_probs(mask_unproposed(draft_probs, num_drafts), target_tokens[:, :gamma])
  return Verdict(num_accepted=num_accepted, next_token=next_token,
                 accept_probability=accept.astype(jnp.float32), overlap=overlap)
