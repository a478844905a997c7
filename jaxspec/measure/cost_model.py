"""What speculative decoding costs per example, fitted from a main-job run, and the alpha a
draft needs for a given speedup.

The main job (scripts/infer.py) records, for each batch, the baseline's output tokens
and seconds, and speculative decoding's target calls, judged drafts and seconds. Least
squares over the batches gives

  baseline:    seconds = fixed + per_token * output tokens
  speculative: seconds = fixed + per_call * target calls + per_draft * drafted tokens

(per_call is everything an iteration costs besides its drafts: the verify step, the
verdict, the loop's own work; with `verify_lengths` it is the run's average over its
verify lengths). The acceptance model of Section 3 (each draft accepted with probability
alpha, independently), with proposals of min(gamma, tokens left) drafts that end at the
output's EOS as the loop's do, gives the expected target calls and drafts of an output
of n tokens exactly (a recursion over the tokens left), and with them the expected
speedup of any (alpha, gamma, per-draft cost) on the run's own output lengths:
`required_alpha` is the least alpha that reaches a speedup.

Pure numpy. Times are in milliseconds.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class BaselineCosts:
  """A baseline example costs fixed_ms + per_token_ms * output tokens (EOS included)."""
  fixed_ms: float
  per_token_ms: float

  def example_ms(self, lengths) -> np.ndarray:
    return self.fixed_ms + self.per_token_ms * np.asarray(lengths, np.float64)


@dataclasses.dataclass(frozen=True)
class SpeculativeCosts:
  """A speculative example costs fixed_ms + per_call_ms * target calls + per_draft_ms *
  drafted tokens."""
  fixed_ms: float
  per_call_ms: float
  per_draft_ms: float

  def example_ms(self, calls, drafts) -> np.ndarray:
    return (self.fixed_ms + self.per_call_ms * np.asarray(calls, np.float64)
            + self.per_draft_ms * np.asarray(drafts, np.float64))


def _least_squares(columns: Sequence[np.ndarray], milliseconds) -> np.ndarray:
  milliseconds = np.asarray(milliseconds, np.float64)
  design = np.stack([np.ones_like(milliseconds)] + [np.asarray(c, np.float64) for c in columns],
                    axis=1)  # [examples, 1 + len(columns)]
  if design.shape[0] < design.shape[1] or np.linalg.matrix_rank(design) < design.shape[1]:
    raise ValueError(f'cannot fit {design.shape[1]} costs from {design.shape[0]} examples: '
                     'the examples must differ in each count')
  coefficients, *_ = np.linalg.lstsq(design, milliseconds, rcond=None)
  return coefficients


def fit_baseline_costs(lengths, milliseconds) -> BaselineCosts:
  """Least squares of each example's milliseconds on its output length [examples]."""
  fixed, per_token = _least_squares([lengths], milliseconds)
  return BaselineCosts(fixed_ms=float(fixed), per_token_ms=float(per_token))


def fit_speculative_costs(calls, drafts, milliseconds) -> SpeculativeCosts:
  """Least squares of each example's milliseconds on its target calls and drafted tokens."""
  fixed, per_call, per_draft = _least_squares([calls, drafts], milliseconds)
  return SpeculativeCosts(fixed_ms=float(fixed), per_call_ms=float(per_call),
                          per_draft_ms=float(per_draft))


def expected_calls_and_drafts(alpha: float, gamma: int, max_length: int):
  """(calls [max_length + 1], drafts [max_length + 1]): the expected target calls and
  drafted tokens of an output of n tokens (EOS included), for n = 0..max_length.

  An iteration with r tokens left drafts d = min(gamma, r) (a proposal ends at the
  output's EOS), accepts j of them with probability alpha^j (1 - alpha) for j < d and
  alpha^d for j = d, and commits min(j + 1, r) tokens: the accepted drafts and the
  target's token after them (none after an accepted EOS).
  """
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f'alpha must be in [0, 1], got {alpha}')
  if int(gamma) != gamma or gamma < 1:
    raise ValueError(f'gamma must be an integer >= 1, got {gamma}')
  calls = np.zeros(max_length + 1)
  drafts = np.zeros(max_length + 1)
  for left in range(1, max_length + 1):
    num_drafts = min(gamma, left)
    accepted = np.arange(num_drafts + 1)  # [d + 1]
    probability = alpha ** accepted * np.where(accepted < num_drafts, 1.0 - alpha, 1.0)
    after = left - np.minimum(accepted + 1, left)  # tokens left after the call [d + 1]
    calls[left] = 1.0 + probability @ calls[after]
    drafts[left] = num_drafts + probability @ drafts[after]
  return calls, drafts


def expected_speedup(alpha: float, gamma: int, lengths, baseline: BaselineCosts,
                     speculative: SpeculativeCosts) -> float:
  """Mean baseline milliseconds over mean expected speculative milliseconds, over the
  output lengths [examples] (EOS included)."""
  lengths = np.asarray(lengths, np.int64)
  if lengths.size == 0 or lengths.min() < 1:
    raise ValueError('lengths must be a non-empty list of output lengths >= 1')
  calls, drafts = expected_calls_and_drafts(alpha, gamma, int(lengths.max()))
  speculative_ms = speculative.example_ms(calls[lengths], drafts[lengths]).mean()
  return float(baseline.example_ms(lengths).mean() / speculative_ms)


def required_alpha(speedup: float, gamma: int, lengths, baseline: BaselineCosts,
                   speculative: SpeculativeCosts, tolerance: float = 1e-4) -> Optional[float]:
  """The least alpha whose expected speedup reaches `speedup` (bisection: fewer calls
  and fewer wasted drafts as alpha grows), or None when even alpha = 1 falls short."""
  reaches = lambda alpha: expected_speedup(  # noqa: E731
      alpha, gamma, lengths, baseline, speculative) >= speedup
  if not reaches(1.0):
    return None
  low, high = 0.0, 1.0
  if reaches(low):
    return 0.0
  while high - low > tolerance:
    middle = 0.5 * (low + high)
    low, high = (low, middle) if reaches(middle) else (middle, high)
  return high
