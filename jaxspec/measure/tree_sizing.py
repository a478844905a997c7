"""Token trees sized for the hardware: the (num_drafts, gamma) that decodes the most tokens
per unit of time, from measured costs and acceptance (as Sequoia, Chen et al. 2024,
sizes its trees from the measured cost of verifying n tokens).

An iteration of tree verification (SpeculativeConfig.num_drafts = m > 1) drafts m
branches of gamma tokens and verifies them in ONE target step over 1 + m gamma
positions (jaxspec.decoding.verification.tree). In target one-position steps it costs

    cost(m, gamma) = V(1 + m gamma) + gamma c

with V(k) the measured cost of a step over k positions against one (V(1) = 1; on an
H200, T5.1.1-XXL's is flat to k = 9) and c the drafter's step against the target's,
its m branches drafted as one batch (pass c per m where drafting more rows costs more).
m = 1 is the chain (Theorem 3.8 with a measured verify step).

The acceptance model. At temperature 0 branch j starts with the draft's j-th most likely
token and continues greedily (`propose_top_branches`). The target's token after the
prefix is the draft's j-th choice with probability alpha_j (exclusive in j; alpha_1 =
alpha), and each later token of a branch is accepted with probability alpha,
independently (the paper's i.i.d. model). The tokens an iteration adds (the accepted
prefix and the target's token after it) then number, in expectation,

    E[tokens](m, gamma) = 1 + A_m (1 - alpha^gamma) / (1 - alpha),  A_m = alpha_1 + ... + alpha_m

(m = 1: Equation 1). Without measured alpha_j, each further choice is taken to catch the
fraction alpha of what the choices before it missed: alpha_j = alpha (1 - alpha)^(j-1),
A_m = 1 - (1 - alpha)^m, the chance that one of m independent candidates is right (which
also describes m i.i.d. sampled branches, each accepted with probability alpha at the
first depth). Real drafts' second and later choices are usually right less often than
that, so pass measured top-k agreement rates (Sequoia's acceptance vector) where known.

  expected_tokens(alpha, gamma, num_drafts, branch_acceptance)  the formula above
  interpolated_cost(verify_costs, positions)  V(k) between measured k (None past them)
  iteration_cost(verify_costs, draft_cost, num_drafts, gamma)
  shapes(...)                               every (m, gamma) whose verify step was measured
  best_shape(...) -> TreeShape              the most tokens per unit of time
  best_chain_and_tree(...) -> (chain, tree) the best with m = 1 and the best overall
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

MAX_DRAFTS = 8  # branches considered by default


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """A tree of num_drafts branches of gamma drafts and what it is predicted to give."""
  num_drafts: int
  gamma: int
  positions: int  # of the verify step: 1 + num_drafts * gamma
  tokens: float  # expected tokens an iteration adds
  cost: float  # an iteration, in target one-position steps
  speedup: float  # tokens / cost: against the baseline's one token per step

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def branch_acceptance_model(alpha: float, num_drafts: int) -> tuple[float, ...]:
  """alpha_j for j = 1..num_drafts without measured rates: alpha (1 - alpha)^(j - 1)."""
  return tuple(alpha * (1.0 - alpha) ** j for j in range(num_drafts))


def _check_acceptance(alpha: float, branch_acceptance: Sequence[float], num_drafts: int):
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f'alpha must be in [0, 1], got {alpha}')
  if len(branch_acceptance) < num_drafts:
    raise ValueError(f'{num_drafts} branches need {num_drafts} acceptance rates, got '
                     f'{len(branch_acceptance)}')
  rates = np.asarray(branch_acceptance[:num_drafts], np.float64)
  if np.any(rates < 0.0) or rates.sum() > 1.0 + 1e-9:
    raise ValueError('branch acceptance rates must be >= 0 and sum to at most 1 (the '
                     f'target takes one token), got {tuple(branch_acceptance)}')


def expected_tokens(alpha: float, gamma: int, num_drafts: int = 1,
                    branch_acceptance: Sequence[float] | None = None) -> float:
  """E[tokens an iteration adds] for num_drafts branches of gamma drafts:
  1 + (alpha_1 + ... + alpha_m) (1 + alpha + ... + alpha^(gamma - 1)).

  branch_acceptance: alpha_j, the rate at which the draft's j-th choice is the target's
  token (None: branch_acceptance_model; alpha_1 should be alpha)."""
  if gamma < 1 or num_drafts < 1:
    raise ValueError(f'gamma and num_drafts must be >= 1, got {gamma}, {num_drafts}')
  if branch_acceptance is None:
    branch_acceptance = branch_acceptance_model(alpha, num_drafts)
  _check_acceptance(alpha, branch_acceptance, num_drafts)
  first = float(np.sum(branch_acceptance[:num_drafts]))
  rest = float(np.sum(alpha ** np.arange(gamma)))  # the branch's own first token, then more
  return 1.0 + first * rest


def interpolated_cost(verify_costs: Mapping[int, float], positions: int) -> float | None:
  """V(positions), linear between the measured k of verify_costs {k: V(k)} (k >= 2, with
  V(1) = 1); None past the largest measured k (never extrapolated)."""
  measured = {1: 1.0, **{int(k): float(v) for k, v in verify_costs.items()}}
  if positions < 1 or positions > max(measured):
    return None
  ks = sorted(measured)
  return float(np.interp(positions, ks, [measured[k] for k in ks]))


def _draft_cost(draft_cost: float | Mapping[int, float], num_drafts: int) -> float | None:
  if isinstance(draft_cost, Mapping):
    value = draft_cost.get(num_drafts)
    return None if value is None else float(value)
  return float(draft_cost)


def iteration_cost(verify_costs: Mapping[int, float], draft_cost: float | Mapping[int, float],
                   num_drafts: int, gamma: int) -> float | None:
  """V(1 + num_drafts gamma) + gamma c, in target one-position steps (None where the
  verify step's width or the drafter's cost at num_drafts was not measured)."""
  verify = interpolated_cost(verify_costs, 1 + num_drafts * gamma)
  c = _draft_cost(draft_cost, num_drafts)
  if verify is None or c is None:
    return None
  return verify + gamma * c


def shapes(verify_costs: Mapping[int, float], draft_cost: float | Mapping[int, float],
           alpha: float, max_drafts: int = MAX_DRAFTS,
           branch_acceptance: Sequence[float] | None = None) -> list[TreeShape]:
  """Every (num_drafts <= max_drafts, gamma >= 1) whose verify step lies within the
  measured widths, with its prediction."""
  widest = max([1, *(int(k) for k in verify_costs)])
  found = []
  for num_drafts in range(1, max_drafts + 1):
    rates = None if branch_acceptance is None else tuple(branch_acceptance)
    if rates is not None and len(rates) < num_drafts:
      break
    for gamma in range(1, (widest - 1) // num_drafts + 1):
      cost = iteration_cost(verify_costs, draft_cost, num_drafts, gamma)
      if cost is None:
        continue
      tokens = expected_tokens(alpha, gamma, num_drafts, rates)
      found.append(TreeShape(num_drafts, gamma, 1 + num_drafts * gamma, tokens, cost,
                             tokens / cost))
  return found


def best_shape(verify_costs: Mapping[int, float], draft_cost: float | Mapping[int, float],
               alpha: float, max_drafts: int = MAX_DRAFTS,
               branch_acceptance: Sequence[float] | None = None) -> TreeShape | None:
  """The shape of the largest predicted speedup (ties: the narrower verify step, then
  fewer branches); None where no verify width beyond 1 was measured."""
  candidates = shapes(verify_costs, draft_cost, alpha, max_drafts, branch_acceptance)
  if not candidates:
    return None
  return max(candidates, key=lambda s: (round(s.speedup, 12), -s.positions, -s.num_drafts))


def best_chain_and_tree(verify_costs: Mapping[int, float],
                        draft_cost: float | Mapping[int, float], alpha: float,
                        max_drafts: int = MAX_DRAFTS,
                        branch_acceptance: Sequence[float] | None = None
                        ) -> tuple[TreeShape | None, TreeShape | None]:
  """(the best chain, num_drafts = 1; the best shape with up to max_drafts branches,
  which is the chain where no tree beats it)."""
  chain = best_shape(verify_costs, draft_cost, alpha, 1, branch_acceptance)
  return chain, best_shape(verify_costs, draft_cost, alpha, max_drafts, branch_acceptance)
