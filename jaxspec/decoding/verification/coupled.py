"""Coupled verification: the drafter draws each position with the Gumbel noise of that
position's key, as the baseline does, and the target draws every verified position with
the same noise; drafts count while they equal the target's draws.

Every committed token is the target's draw with its position's noise, so the output is
the baseline's for the same PRNG key, token for token, with no q, residual or accept
draws. A draft passes with probability P(coupled draws agree), at least
(1 - TV) / (1 + TV) against Algorithm 1's 1 - TV. Exact only, a fixed gamma (RULE).

Shape letters: b batch, g gamma (drafted positions), v vocab.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxspec.decoding.verification.rule import VerificationRule
from jaxspec.decoding.verification.token import Verdict, matching_verdict
from jaxspec.sampling import SamplingConfig, adjusted_logits, argmax, gumbel_max

RULE = VerificationRule(name='coupled', exact_only=True, adaptive_gamma=False,
                        multi_draft=False, verify_lengths=True)


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
  num_accepted, next_token, accept = matching_verdict(draft_tokens, target_tokens, num_drafts)
  agreement = accept.astype(jnp.float32)
  return Verdict(num_accepted=num_accepted, next_token=next_token,
                 accept_probability=agreement, overlap=agreement)
