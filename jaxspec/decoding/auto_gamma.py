"""gamma chosen per batch from measured costs: speculative decoding that never loses.

Every gamma is exact (at temperature 0 the output is the baseline's token for token, with
coupled verification its very draws, otherwise the target's distribution), so gamma is a
speed setting only, and which one pays depends on the batch size and the machine. On a
2-core CPU a verify step over b rows x (gamma + 1) positions is nearly free at b = 1 and
compute-bound by b = 8, where speculation with any gamma loses to the baseline; on an
accelerator the crossover sits elsewhere. gamma = 0 means the baseline itself.

The model. A batch decodes until its longest row ends.
  baseline:     time = batch_seconds + steps x step_seconds,
                steps = the longest row's tokens
  speculative:  time = batch_seconds + iterations x call_seconds[g] + drafts x draft_seconds,
                iterations = the most any row takes, drafts = the draft steps it runs
(batch_seconds: what a batch costs once whatever decodes it, its encoder and caches)
Each iteration of a row accepts its drafts up to the first rejection, each accepted with
probability alpha (the paper's i.i.d. model, Section 3.1), and adds one token; a proposal
drafts min(g, tokens left), as the loop's end at the output's EOS. So an output of 4
tokens costs gamma 19 what it costs gamma 9 (one call, 4 drafts), and 19 saves calls on
outputs longer than 10 only; a price a call alone (each gamma's mean over the
calibration's outputs, drafts and all) charged short outputs for drafts they never ran
and sent a run from 19 to 9 on the short strings a split opens with. E[iterations],
E[drafts] and E[steps] follow from the output lengths seen so far and alpha
(`expected_batch_iterations`, `expected_batch_drafts`); the costs are measured on the
machine, for the pair and the batch size (`BatchCosts`, by `AutoGammaDecoder.calibrate`
from whole decodes, so the loop's own bookkeeping is in them: `fit_batch_costs`), and
alpha is the running estimate (Corollary 3.6) over every speculative batch decoded so far.

As the run goes on it measures itself: the seconds of each gamma's batches against what
the model predicted for exactly those batches (their output lengths) give how far that
gamma runs off its prediction, which scales its prediction once it has decoded a few
batches, and the other gammas' predictions alike (`scaled_by_ratios`: what moves one gamma
off its prediction, the machine's speed that hour or the model's error, moves all of
them), so a gamma that does worse in the run than the others would is dropped, and a
gamma that decoded the run's short strings is not judged against one that decoded its
long ones.

The same on every platform: each timing waits for the decoder's outputs on the device
(`jax.block_until_ready`; on a GPU or TPU a call returns as soon as its work is queued),
a decoder runs once untimed on shapes it has not decoded (it compiles), calibrations are
keyed by the device kind and count besides the models (their dtype among their settings)
and the batch size, and the choice is arithmetic on the seconds measured.

`choose_gamma` is pure (a cost table and alpha in, gamma out); `AutoGammaDecoder` decodes
batches with it, measuring as it goes; `GammaCostCache` keeps calibrations in JSON files
keyed by machine, pair, dtype, platform and batch size, so a later run starts from them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import machine
from jaxspec.errors import InvalidSetting
from jaxspec.decoding.beam_search import BeamOutput
from jaxspec.decoding.common import DecodeOutput
from jaxspec.decoding.speculative_beam import (SpeculativeBeamConfig, SpeculativeBeamOutput,
                                               SpeculativeBeamStats)
from jaxspec.decoding.speculative import AUTO  # noqa: F401  (re-exported)
from jaxspec.decoding.speculative import SpeculativeConfig, SpeculativeOutput, SpeculativeStats
from jaxspec.measure import cost_model

DEFAULT_GAMMAS = (1, 2, 3, 5, 9)  # gammas measured by calibration (gamma 0 always is)
# Calibration rounds: each decodes the calibration batches once with every candidate,
# interleaved, and each candidate keeps its fastest round. The gammas that pay at a few
# rows differ by a few percent, less than one round's noise on a shared 2-core machine
# (at batch 4 on the EPYC, three calibrations of two rounds put gamma 3's predicted
# speedup at 1.09x, 1.20x and 1.07x, and one chose gamma 5; of five rounds, 1.19x-1.24x,
# choosing gamma 2 or 3); so rounds go on to CALIBRATION_ROUNDS[1] while they fit
# CALIBRATION_SECONDS (five rounds of batch 4 take ~20 s), never fewer than
# CALIBRATION_ROUNDS[0].
CALIBRATION_ROUNDS = (2, 5)
CALIBRATION_SECONDS = 60.0
# Speculation is chosen only where the model predicts at least this speedup: below it a
# prediction error would cost more than the gain.
MIN_SPEEDUP = 1.05
CACHE_DIR_ENV = 'JAXSPEC_CALIBRATION_DIR'


@dataclasses.dataclass
class BatchCosts:
  """Measured at one batch size (`fit_batch_costs`): a batch costs batch_seconds once
  (its encoder and caches, whatever decodes it), plus step_seconds a baseline step, or
  for a speculative decode with gamma g, call_seconds[g] an iteration (the verify step,
  the verdict, the loop's own work) and draft_seconds a draft step it runs.

  Where the costs come from whole decodes of real batches, `measured_speedup[g]` is the
  baseline's time over gamma g's on those same batches, at `alpha` with `lengths`: the
  model's prediction is scaled to agree with it there (`predicted_speedups`), so what
  the model leaves out (rows finishing apart, the first proposal, cache effects) is
  carried by the measurement and only the drift of alpha and lengths by the model."""
  batch_size: int
  step_seconds: float
  call_seconds: dict[int, float]
  measured_speedup: dict[int, float] = dataclasses.field(default_factory=dict)
  alpha: float | None = None  # over the measured batches
  lengths: tuple[int, ...] = ()  # output lengths of the measured batches
  draft_seconds: float = 0.0
  batch_seconds: float = 0.0

  def to_json(self) -> dict:
    return {'batch_size': self.batch_size, 'batch_seconds': self.batch_seconds,
            'step_seconds': self.step_seconds,
            'call_seconds': {str(g): s for g, s in self.call_seconds.items()},
            'draft_seconds': self.draft_seconds,
            'measured_speedup': {str(g): s for g, s in self.measured_speedup.items()},
            'alpha': self.alpha, 'lengths': list(self.lengths)}

  @classmethod
  def from_json(cls, data: Mapping[str, Any]) -> 'BatchCosts':
    return cls(batch_size=int(data['batch_size']), step_seconds=float(data['step_seconds']),
               call_seconds={int(g): float(s) for g, s in data['call_seconds'].items()},
               draft_seconds=float(data.get('draft_seconds', 0.0)),
               batch_seconds=float(data.get('batch_seconds', 0.0)),
               measured_speedup={int(g): float(s)
                                 for g, s in data.get('measured_speedup', {}).items()},
               alpha=data.get('alpha'), lengths=tuple(data.get('lengths', ())))

  def baseline_seconds(self, steps):
    """A baseline batch's seconds: its steps (its longest row's tokens)."""
    return self.batch_seconds + steps * self.step_seconds

  def seconds(self, gamma: int, iterations, drafts):
    """A speculative batch's seconds with gamma: its iterations and draft steps."""
    return (self.batch_seconds + iterations * self.call_seconds[gamma]
            + drafts * self.draft_seconds)


def fit_batch_costs(batch_size: int, plain: Sequence[tuple[float, int]],
                    speculative: Mapping[int, Sequence[tuple[float, int, int]]]) -> BatchCosts:
  """BatchCosts from decoded batches: plain [(seconds, steps)] of the baseline and
  speculative {gamma: [(seconds, target calls, draft steps)]}. Least squares over every
  batch at once, none negative: one cost a batch (its encoder and caches: the same
  whatever decodes it), a step, a draft step (the same program whatever gamma ran it),
  and a call for each gamma (the verify width differs), fitted as a step plus what the
  call costs beyond it: a call verifies at least the one position a baseline step
  computes, so it never costs less (where drafts run nearly in one proportion to calls,
  as in a batch that drafts while any row does, a free fit trades the two against each
  other and can price a call under a step, even at 0). A cost the batches cannot tell
  apart from the others is 0 and they carry it: the draft step's where each gamma's
  batches draft in one proportion to their calls (alpha 1, outputs of one length), the
  batch's where every batch has one length."""
  gammas = sorted(speculative)
  # [batches, 3 + gammas]: batch, step, draft step, each gamma's call beyond a step
  design, seconds = [], []
  for elapsed, steps in plain:
    design.append([1.0, steps, 0.0] + [0.0] * len(gammas))
    seconds.append(elapsed)
  for i, gamma in enumerate(gammas):
    for elapsed, calls, drafts in speculative[gamma]:
      row = [1.0, calls, drafts] + [0.0] * len(gammas)
      row[3 + i] = calls
      design.append(row)
      seconds.append(elapsed)
  solution = _non_negative_least_squares(np.array(design), np.array(seconds),
                                         optional=(2, 0))
  step = float(solution[1])
  return BatchCosts(batch_size=batch_size, batch_seconds=float(solution[0]),
                    step_seconds=step, draft_seconds=float(solution[2]),
                    call_seconds={g: step + float(solution[3 + i])
                                  for i, g in enumerate(gammas)})


def _non_negative_least_squares(design: np.ndarray, target: np.ndarray,
                                optional: Sequence[int] = ()) -> np.ndarray:
  """argmin |design x - target| over x >= 0 (Lawson and Hanson's active set). The
  `optional` columns, in order, are held at 0 while the design's columns are not
  independent without them."""
  usable = np.ones(design.shape[1], bool)
  for column in optional:
    if np.linalg.matrix_rank(design[:, usable]) < usable.sum():
      usable[column] = False
  solution = np.zeros(design.shape[1])
  free = np.zeros_like(usable)
  tolerance = 1e-12 * max(1.0, float(np.abs(design).sum() * np.abs(target).max(initial=0)))
  for _ in range(3 * design.shape[1]):
    gradient = design.T @ (target - design @ solution)
    candidates = usable & ~free & (gradient > tolerance)
    if not candidates.any():
      break
    free[np.argmax(np.where(candidates, gradient, -np.inf))] = True
    while True:
      trial = np.zeros_like(solution)
      trial[free], *_ = np.linalg.lstsq(design[:, free], target, rcond=None)
      if np.all(trial[free] > 0.0):
        solution = trial
        break
      # Step from the current solution toward the trial as far as every cost stays >= 0.
      shrinking = np.flatnonzero(free & (trial <= 0.0))
      ratio = solution[shrinking] / np.maximum(solution[shrinking] - trial[shrinking], 1e-300)
      solution = solution + ratio.min() * (trial - solution)
      solution[shrinking[np.argmin(ratio)]] = 0.0  # leaves the set whatever the rounding
      free &= solution > 0.0
      solution[~free] = 0.0
  return solution


def row_iterations(lengths: np.ndarray, alpha: float, gamma: int,
                   rng: np.random.Generator) -> np.ndarray:
  """Iterations each row of lengths [...] (its tokens, EOS included) takes under the
  i.i.d. acceptance model, drawn: per iteration min(Geometric, gamma) accepted drafts
  plus one token. -> [...] int. (A simulation of what expected_batch_iterations
  computes exactly.)"""
  produced = np.zeros(lengths.shape, np.int64)
  iterations = np.zeros(lengths.shape, np.int64)
  while np.any(produced < lengths):
    decoding = produced < lengths
    if alpha >= 1.0:
      accepted = np.full(lengths.shape, gamma)
    elif alpha <= 0.0:
      accepted = np.zeros(lengths.shape, np.int64)
    else:  # successes before the first failure, at most gamma
      accepted = np.minimum(rng.geometric(1.0 - alpha, lengths.shape) - 1, gamma)
    produced += np.where(decoding, accepted + 1, 0)
    iterations += decoding
  return iterations


def iteration_tokens(alpha: float, gamma: int) -> np.ndarray:
  """[gamma + 2]: P(an iteration adds j tokens), j = 0..gamma + 1: its drafts accepted
  up to the first rejection, at most gamma (each with probability alpha), plus one."""
  accepted = np.arange(gamma + 1)
  probs = np.zeros(gamma + 2)
  probs[1:] = float(alpha) ** accepted * np.where(accepted < gamma, 1.0 - alpha, 1.0)
  return probs


def _cached_alpha(alpha) -> float:
  """alpha as the cached tables key it: a float rounded to 12 digits, so that a running
  alpha equal up to rounding hits the same entry."""
  return round(float(alpha), 12)


@functools.lru_cache(maxsize=64)
def done_within(longest: int, alpha: float, gamma: int) -> np.ndarray:
  """[K + 1, L + 1] with K = L = longest: entry [k, n] is P(a row of n tokens is done
  within k iterations) = P(k iterations add at least n tokens) (a row needs at most n).
  The distribution of the tokens k iterations add, capped at L, convolved step by step."""
  step = iteration_tokens(alpha, gamma)
  tokens = np.zeros(longest + 1)  # [L + 1] after k iterations; index L holds >= L
  tokens[0] = 1.0
  done = np.empty((longest + 1, longest + 1))
  for k in range(longest + 1):
    done[k] = np.concatenate([[1.0], 1.0 - np.cumsum(tokens)[:-1]])  # P(tokens >= n)
    spread = np.convolve(tokens, step)  # [L + gamma + 2]
    tokens = np.concatenate([spread[:longest], [spread[longest:].sum()]])
  done = np.clip(done, 0.0, 1.0)
  done.flags.writeable = False  # shared by every caller (cached)
  return done


def _longest_row(lengths: Sequence[int], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """(frequency [L + 1] of the lengths, at_most [L + 1]: P(the longest of batch_size rows
  drawn from them is <= m))."""
  lengths = np.asarray(lengths, np.int64)
  frequency = np.bincount(lengths, minlength=int(lengths.max()) + 1) / lengths.size
  return frequency, np.cumsum(frequency) ** batch_size


def expected_batch_iterations(lengths: Sequence[int], alpha: float, gamma: int,
                              batch_size: int) -> tuple[float, float]:
  """(E[baseline steps], E[speculative iterations]) of a batch of batch_size rows whose
  lengths are drawn from `lengths` (outputs seen, EOS included): the longest row's
  tokens, and the most iterations any row takes with `gamma` at `alpha`.

  Exact, not simulated: the most of B i.i.d. draws is at most m with probability
  P(one is)^B, so E[most] = sum_m (1 - P(one <= m)^B), over the lengths' frequencies
  and each length's iterations (done_within). Milliseconds: a decision runs between
  batches, which take tens of milliseconds on an accelerator (a simulation of 512
  batches took 0.1-0.4 s a decision there, a tenth of the run's time and more)."""
  frequency, longest_at_most = _longest_row(lengths, batch_size)
  steps = float(np.sum(1.0 - longest_at_most[:-1]))
  if gamma == 0:
    return steps, steps
  # [K + 1]: P(a drawn row is done within k iterations)
  done = done_within(frequency.size - 1, _cached_alpha(alpha), gamma) @ frequency
  return steps, float(np.sum(1.0 - np.minimum(done[:-1], 1.0) ** batch_size))


@functools.lru_cache(maxsize=64)
def row_calls_and_drafts(longest: int, alpha: float, gamma: int
                         ) -> tuple[np.ndarray, np.ndarray]:
  """(calls [L + 1], drafts [L + 1]) with L = longest: a row of n tokens' expected target
  calls and drafted tokens (cost_model's recursion: a proposal drafts min(gamma, tokens
  left), ending at the output's EOS as the loop's do). Read-only: shared (cached)."""
  calls, drafts = cost_model.expected_calls_and_drafts(alpha, gamma, longest)
  calls.flags.writeable = drafts.flags.writeable = False
  return calls, drafts


def _drafts_a_call(alpha: float, gamma: int, longest_row: np.ndarray) -> float:
  """E[draft steps a target call] of a batch whose longest row's length is distributed
  as longest_row [L + 1]: that row's expected drafts over its expected calls (the loop
  drafts while any row's proposal goes on, and the longest row's goes on the longest)."""
  calls, drafts = row_calls_and_drafts(longest_row.size - 1, _cached_alpha(alpha), gamma)
  return float(longest_row @ drafts) / max(float(longest_row @ calls), 1e-12)


def expected_batch_drafts(lengths: Sequence[int], alpha: float, gamma: int,
                          batch_size: int, iterations: float | None = None) -> float:
  """E[draft steps] of a batch of batch_size rows drawn from `lengths`: its iterations
  (expected_batch_iterations, unless given) times its longest row's drafts a call. Exact
  at batch 1 (a row's expected drafts); at larger batches the drafts of rows that outlast
  the longest one's calls are counted at that row's rate."""
  _, longest_at_most = _longest_row(lengths, batch_size)
  longest_row = np.diff(longest_at_most, prepend=0.0)  # [L + 1] P(longest = m)
  if iterations is None:
    _, iterations = expected_batch_iterations(lengths, alpha, gamma, batch_size)
  return iterations * _drafts_a_call(alpha, gamma, longest_row)


def expected_rows_work(rows: Sequence[int], alpha: float, gamma: int,
                       horizon: int | None = None) -> tuple[float, float, float]:
  """(steps, E[iterations], E[draft steps]) of a batch of exactly these rows' lengths:
  what the model predicts for a batch already decoded. horizon: any length >= the
  longest row (decisions pass one for all batches, so that their tables are shared)."""
  rows = np.asarray(rows, np.int64)
  longest = int(rows.max())
  horizon = max(longest, horizon or 0)
  done = done_within(horizon, _cached_alpha(alpha), gamma)[:, rows]  # [K + 1, b]
  iterations = float(np.sum(1.0 - np.prod(done[:-1], axis=1)))
  calls, drafts = row_calls_and_drafts(horizon, _cached_alpha(alpha), gamma)
  return float(longest), iterations, iterations * drafts[longest] / max(calls[longest], 1e-12)


def model_speedups(costs: BatchCosts, alpha: float, lengths: Sequence[int]
                   ) -> dict[int, float]:
  """{gamma: baseline time / speculative time} by the model alone (0: 1.0)."""
  speedups = {0: 1.0}
  for gamma in sorted(costs.call_seconds):
    steps, iterations = expected_batch_iterations(lengths, alpha, gamma, costs.batch_size)
    drafts = (expected_batch_drafts(lengths, alpha, gamma, costs.batch_size, iterations)
              if costs.draft_seconds else 0.0)
    seconds = costs.seconds(gamma, iterations, drafts)
    speedups[gamma] = costs.baseline_seconds(steps) / max(seconds, 1e-12)
  return speedups


def calibration_scales(costs: BatchCosts) -> dict[int, float]:
  """{gamma: measured speedup / the model's} at the calibration's own alpha and lengths,
  where the costs carry a measurement (else empty): what the model leaves out."""
  if not (costs.measured_speedup and costs.alpha is not None and costs.lengths):
    return {}
  at_measurement = model_speedups(costs, costs.alpha, costs.lengths)
  return {g: measured / max(at_measurement[g], 1e-12)
          for g, measured in costs.measured_speedup.items() if g in at_measurement}


def predicted_speedups(costs: BatchCosts, alpha: float, lengths: Sequence[int]
                       ) -> dict[int, float]:
  """{gamma: predicted speedup} at `alpha` with outputs of `lengths`: the model's, scaled
  by measured / modelled at the measurement's own alpha and lengths where the costs
  carry a measurement."""
  speedups = model_speedups(costs, alpha, lengths)
  for gamma, scale in calibration_scales(costs).items():
    speedups[gamma] *= scale
  return speedups


def predicted_batch_seconds(costs: BatchCosts, alpha: float, gamma: int,
                            rows: Sequence[int], horizon: int | None = None,
                            scales: Mapping[int, float] | None = None) -> float:
  """The seconds `predicted_speedups` expects of gamma on a batch of exactly these rows'
  output lengths (the model's, over the calibration's scale; `scales`: the costs'
  calibration_scales, where the caller has them)."""
  steps, iterations, drafts = expected_rows_work(rows, alpha, gamma, horizon)
  if gamma == 0:
    return costs.baseline_seconds(steps)
  scales = calibration_scales(costs) if scales is None else scales
  return costs.seconds(gamma, iterations, drafts) / scales.get(gamma, 1.0)


def scaled_by_ratios(predicted: Mapping[int, float], ratios: Mapping[int, float] | None
                     ) -> dict[int, float]:
  """{gamma: speedup}: each prediction times the ratio its gamma realized in the run
  (realized / predicted, on its own batches), the gammas without one by the geometric
  mean of the others'. What moves a gamma off its prediction (the machine's speed that
  hour, the baseline's cost the calibration measured, the model's error) moves every
  gamma alike, so a gamma that realized 5% under its prediction is compared with the
  others' predictions 5% lower, not with their calibration-time values (which sent runs
  from the best gamma to worse ones). Gamma 0, the baseline itself, stays 1."""
  ratios = {g: r for g, r in (ratios or {}).items() if g and g in predicted and r > 0.0}
  scale = float(np.exp(np.mean(np.log(list(ratios.values()))))) if ratios else 1.0
  return {g: (v if g == 0 else v * ratios.get(g, scale)) for g, v in predicted.items()}


def with_realized(predicted: Mapping[int, float], realized: Mapping[int, float] | None
                  ) -> dict[int, float]:
  """{gamma: speedup}: the run's realized speedups where it has them, the others'
  predictions scaled as the realized ones fell from their own (`scaled_by_ratios`)."""
  realized = {g: v for g, v in (realized or {}).items() if predicted.get(g, 0.0) > 0.0}
  return {**scaled_by_ratios(predicted, {g: v / predicted[g] for g, v in realized.items()}),
          **realized}


def choose_gamma(costs: BatchCosts, alpha: float, lengths: Sequence[int],
                 min_speedup: float = MIN_SPEEDUP, current: int | None = None,
                 ratios: Mapping[int, float] | None = None) -> int:
  """The gamma of the largest predicted speedup; 0 (the baseline) unless some gamma is
  predicted at least min_speedup. `ratios` ({gamma: realized / predicted on its own
  batches}, the run's) scale the predictions (`scaled_by_ratios`).
  With `current` (the gamma in use), a switch needs the new gamma predicted min_speedup
  times faster than it: each program compiles on first use, and flipping between
  near-equal choices would only pay compiles."""
  speedups = scaled_by_ratios(predicted_speedups(costs, alpha, lengths), ratios)
  best = max(speedups, key=lambda g: (speedups[g], -g))
  if not best or speedups[best] < min_speedup:
    return 0  # no gamma pays clearly: the baseline, whatever ran before
  if current and current in speedups and best != current:
    if speedups[best] < min_speedup * speedups[current]:
      return current
  return best


def host_array(value) -> np.ndarray:
  """`value` (a device array, or one already on the host) as a numpy array: one copy from
  the device, which the array keeps, so a second read costs nothing. np.asarray, not
  jax.device_get: the decoders read a few small arrays after every batch, and
  device_get's pytree handling cost ten times the copy (~20 us against ~2 us a read)."""
  return np.asarray(value)


@jax.jit
def _plain_decode_stats(lengths):
  """A plain decode's SpeculativeStats from its lengths [b]: one target call a token (the
  batch's steps: its longest row), no drafts; on the device, so that wrapping a baseline
  decode reads nothing back to the host (its reader does, as it reads a speculative
  decode's)."""
  lengths = lengths.astype(jnp.int32)
  steps = jnp.max(lengths)
  zero = jnp.zeros((), jnp.int32)
  return SpeculativeStats(
      target_calls=steps, draft_calls=zero, row_target_calls=lengths,
      accepted_per_position=jnp.zeros((0,), jnp.int32),
      num_accepted_counts=jnp.zeros((1,), jnp.int32), overlap_sum=jnp.zeros((), jnp.float32),
      verified_positions=zero, num_drafted_counts=jnp.zeros((1,), jnp.int32),
      target_positions=steps * lengths.shape[0])


def as_speculative_output(output: DecodeOutput) -> SpeculativeOutput:
  """A baseline decode as a gamma-0 SpeculativeOutput (`_plain_decode_stats`)."""
  return SpeculativeOutput(output=output, stats=_plain_decode_stats(output.lengths))


@jax.jit
def _plain_beam_stats(steps):
  """Plain beam search's SpeculativeBeamStats from its search steps []: one target call
  a step, each advancing one step, no draft calls; on the device."""
  steps = steps.astype(jnp.int32)
  return SpeculativeBeamStats(target_calls=steps, draft_calls=jnp.zeros((), jnp.int32),
                              steps_per_call=jnp.stack([jnp.zeros((), jnp.int32), steps]))


def as_speculative_beam_output(output: BeamOutput) -> SpeculativeBeamOutput:
  """Plain beam search as a gamma-0 SpeculativeBeamOutput (`_plain_beam_stats`)."""
  return SpeculativeBeamOutput(output=output, stats=_plain_beam_stats(output.steps))


def calibration_key(**parts) -> dict:
  """A calibration's cache key: the machine (jaxspec.machine.description), jaxspec's
  code (machine.code_digest: new code measures anew) and `parts` (models, settings,
  lengths), as JSON values."""
  return json.loads(json.dumps({'machine': machine.description(),
                                'code': machine.code_digest(), **parts}, default=str))


class GammaCostCache:
  """Calibrations in JSON files under `directory` ($JAXSPEC_CALIBRATION_DIR, default
  ~/.cache/jaxspec/gamma_costs), one a key: {'key': what was measured, 'costs',
  'alpha', 'lengths'}."""

  def __init__(self, directory: str | os.PathLike | None = None):
    default = pathlib.Path(os.environ.get('XDG_CACHE_HOME', pathlib.Path.home() / '.cache'))
    self.directory = pathlib.Path(directory or os.environ.get(CACHE_DIR_ENV)
                                  or default / 'jaxspec' / 'gamma_costs')

  def path(self, key: Mapping[str, Any]) -> pathlib.Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return self.directory / f'{digest}.json'

  def load(self, key: Mapping[str, Any]) -> dict | None:
    path = self.path(key)
    try:
      data = json.loads(path.read_text())
    except (OSError, ValueError):
      return None
    return data if data.get('key') == json.loads(json.dumps(key)) else None

  def save(self, key: Mapping[str, Any], costs: BatchCosts, alpha: float,
           lengths: Sequence[int]):
    path = self.path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f'.tmp{os.getpid()}')
    scratch.write_text(json.dumps({'key': key, 'costs': costs.to_json(), 'alpha': alpha,
                                   'lengths': [int(n) for n in lengths]}, indent=1))
    os.replace(scratch, path)


def _timed(decode: Callable, batch, clock: Callable[[], float] = time.perf_counter):
  """(output, seconds) of decode(batch), its device work waited for: on a GPU or TPU the
  call returns once its work is queued, so the clock stops only when every output array
  is ready (jax.block_until_ready), whatever the platform."""
  start = clock()
  output = jax.block_until_ready(decode(batch))
  return output, clock() - start


class _ChoosingDecoder:
  """What both automatic decoders share. `_decoder(gamma)` decodes a batch with a gamma,
  0 being the plain decoder (its output wrapped as the speculative one's); a choice is
  compiled for a batch's shapes before the caller's clock starts (`ready`); and the run
  measures itself: each batch's plain work (`_work`: the steps the plain decoder would
  run) times the plain decoder's seconds a step, over the seconds the chosen gamma took,
  is the speedup that gamma realized, which replaces calibrations and predictions once a
  gamma has decoded REALIZED_BATCHES batches."""

  REALIZED_BATCHES = 4
  PLAIN_STEPS = 64  # plain steps of the run's own before its step cost replaces calibration
  UNREAD_PLAIN = 32  # plain decodes kept on the device, unread, at most

  def __init__(self, gammas: Sequence[int], min_speedup: float,
               clock: Callable[[], float] = time.perf_counter):
    self.gammas = tuple(sorted(set(int(g) for g in gammas)))
    if not self.gammas or self.gammas[0] < 1:
      raise InvalidSetting(f'auto gammas must be integers >= 1 (0, the plain decoder, is always '
                           f'a choice), got {tuple(gammas)!r}')
    self.min_speedup = min_speedup
    self.clock = clock  # seconds; every timing waits for the device (_timed)
    self.gamma_counts: dict[int, int] = {}
    self._next: int | None = None  # decided by ready() for the next call
    self._compiled: set = set()  # (gamma, batch shapes) that have run
    # gamma -> [the plain decoder's seconds for its batches, their seconds, batches]
    self._realized: dict[int, list] = {}
    self._plain_seconds, self._plain_steps, self._plain_batches = 0.0, 0, 0
    # Plain decodes not yet read back (`_read_plain`): the plain decoder's batches leave
    # their outputs on the device until a decision or a caller needs what they say.
    self._unread_plain: list = []

  # What a subclass defines.
  def _decoder(self, gamma: int) -> Callable:
    raise NotImplementedError

  def _work(self, output) -> int:
    raise NotImplementedError

  def _calibrated_step_seconds(self) -> float:
    raise NotImplementedError

  def _observe(self, gamma: int, output):
    """What a decoded batch says besides its time (alpha, lengths); nothing by default."""

  def _plain_reads(self, output):
    """The device array of a plain decode's output that its bookkeeping reads."""
    raise NotImplementedError

  def _count_plain(self, read: np.ndarray):
    """A plain decode's bookkeeping from its `_plain_reads`, on the host: its steps into
    the run's plain steps, and what `_observe` keeps."""
    raise NotImplementedError

  def choose(self) -> int:
    raise NotImplementedError

  # Shared.
  def _read_plain(self):
    """What the plain decodes since the last read say (their steps, `_observe`), read
    back from the device in one go: a batch the plain decoder decodes costs no host round
    trip beyond the wait its caller's timing makes (a read after each batch cost the
    shipped pair on an H200 a fifth of its baseline's time)."""
    unread, self._unread_plain = self._unread_plain, []
    if unread:
      for read in jax.device_get([self._plain_reads(output) for output in unread]):
        self._count_plain(np.asarray(read))

  def plain_step_seconds(self) -> float:
    """The plain decoder's seconds a step: the run's own once it ran PLAIN_STEPS steps."""
    self._read_plain()
    if self._plain_steps >= self.PLAIN_STEPS:
      return self._plain_seconds / self._plain_steps
    return self._calibrated_step_seconds()

  def realized_speedups(self) -> dict[int, float]:
    return {g: plain / max(seconds, 1e-12)
            for g, (plain, seconds, batches) in self._realized.items()
            if g and batches >= self.REALIZED_BATCHES}

  def _compile(self, gamma: int, batch):
    shapes = (gamma, tuple(np.shape(leaf) for leaf in jax.tree_util.tree_leaves(batch)))
    if shapes not in self._compiled:
      jax.block_until_ready(self._decoder(gamma)(batch))
      self._compiled.add(shapes)

  def _time_candidates(self, batches: Sequence[Any], rounds: tuple[int, int],
                       budget_seconds: float = 0.0):
    """({gamma: the seconds of each batch [len(batches)] in the fastest round of
    decoding `batches`}, {gamma: the first round's outputs}) for 0 and every gamma,
    compiled first and interleaved batch by batch so that load hits all alike. rounds
    (least, most): rounds past the least run while another one fits in budget_seconds
    of timed decoding."""
    candidates = (0,) + self.gammas
    for gamma in candidates:
      for batch in batches:
        self._compile(gamma, batch)
    fastest = {g: [np.inf] for g in candidates}
    outputs: dict[int, list] = {g: [] for g in candidates}
    least, most = rounds
    spent = 0.0
    for repeat in range(most):
      if repeat >= max(least, 1) and spent * (repeat + 1) / repeat > budget_seconds:
        break
      seconds: dict[int, list] = {g: [] for g in candidates}
      for batch in batches:
        for gamma in candidates:
          output, elapsed = _timed(self._decoder(gamma), batch, self.clock)
          seconds[gamma].append(elapsed)
          if repeat == 0:
            outputs[gamma].append(output)
      spent += sum(map(sum, seconds.values()))
      fastest = {g: min(fastest[g], seconds[g], key=sum) for g in candidates}
    return fastest, outputs

  def ready(self, batch):
    """Decides the gamma for `batch` and, where that decoder has not yet run on a batch
    of its shapes, runs it once (it compiles), so that the timed call that follows
    decodes only. Callers that time each batch call it before the clock starts."""
    self._next = self.choose()
    self._compile(self._next, batch)

  def __call__(self, batch):
    gamma, self._next = (self.choose() if self._next is None else self._next), None
    # Compiled untimed first where it has not run on these shapes (a caller's warm-up
    # call, a caller that never calls ready()): a compile timed into a batch's seconds
    # made the run's realized speedup a fifth of the true one (seconds of compiles
    # against a tenth of a second of decoding), and the decoder dropped the best gamma.
    self._compile(gamma, batch)
    self.gamma_counts[gamma] = self.gamma_counts.get(gamma, 0) + 1
    output, seconds = _timed(self._decoder(gamma), batch, self.clock)
    if gamma == 0:
      self._plain_seconds += seconds
      self._plain_batches += 1
      self._unread_plain.append(output)
      if len(self._unread_plain) >= self.UNREAD_PLAIN:
        self._read_plain()
    else:
      self._record(gamma, output, seconds)
      self._observe(gamma, output)
    return output

  def _record(self, gamma: int, output, seconds: float):
    """Keeps what a batch decoded with gamma (not 0) realized: by default the plain
    decoder's seconds for its work (`realized_speedups`)."""
    entry = self._realized.setdefault(gamma, [0.0, 0.0, 0])
    entry[0] += self.plain_step_seconds() * self._work(output)
    entry[1] += seconds
    entry[2] += 1


class AutoGammaDecoder(_ChoosingDecoder):
  """Speculative decoding with gamma chosen per batch (0: the baseline), from costs
  measured for this batch size and the running alpha and output lengths.

  decode_baseline(batch) -> DecodeOutput and decode_speculative(batch, spec) ->
  SpeculativeOutput decode one batch (the caller's arrays: tokens, keys, placement);
  spec is `spec` with the chosen gamma (verify_lengths kept where they fit it).
  Calling the decoder returns a SpeculativeOutput whatever it chose (a baseline decode as
  gamma 0: `as_speculative_output`); `gamma_counts` says how often it chose each gamma.
  clock: the seconds every timing reads (a test's simulated device, say).
  """

  def __init__(self, decode_baseline: Callable, decode_speculative: Callable,
               spec: SpeculativeConfig, *, batch_size: int,
               gammas: Sequence[int] = DEFAULT_GAMMAS, key: Mapping[str, Any] | None = None,
               cache: GammaCostCache | None = None, min_speedup: float = MIN_SPEEDUP,
               refresh_batches: int = 32, clock: Callable[[], float] = time.perf_counter):
    super().__init__(gammas, min_speedup, clock)
    self.decode_baseline, self.decode_speculative = decode_baseline, decode_speculative
    self.spec, self.batch_size = spec, batch_size
    self.key = (None if key is None else
                {**key, 'batch_size': batch_size, 'gammas': self.gammas})
    self.cache = cache
    self.costs: BatchCosts | None = None
    self.overlap_sum, self.verified_positions = 0.0, 0
    self._lengths: list[int] = []  # the output lengths seen (`lengths`)
    self.current: int | None = None  # the gamma in use
    self.refresh_batches = refresh_batches
    self._since_decision = 0
    self._alpha_prior: float | None = None
    # gamma -> {a batch's output lengths, sorted: [batches, their seconds]}
    self._batches: dict[int, dict[tuple[int, ...], list]] = {}

  def spec_for(self, gamma: int) -> SpeculativeConfig:
    lengths = tuple(k for k in self.spec.verify_lengths if k <= gamma)
    return dataclasses.replace(self.spec, gamma=gamma, verify_lengths=lengths)

  def _decoder(self, gamma: int) -> Callable:
    if gamma == 0:
      return lambda batch: as_speculative_output(self.decode_baseline(batch))
    return lambda batch: self.decode_speculative(batch, self.spec_for(gamma))

  def _work(self, output: SpeculativeOutput) -> int:
    return int(host_array(output.output.lengths).max())

  def _plain_reads(self, output: SpeculativeOutput):
    return output.output.lengths  # [b]

  def _count_plain(self, read: np.ndarray):
    self._plain_steps += int(read.max())
    self._lengths.extend(read.tolist())

  def _calibrated_step_seconds(self) -> float:
    return self.costs.step_seconds

  def _observe(self, gamma: int, output: SpeculativeOutput, lengths: bool = True):
    if gamma:
      self.overlap_sum += float(host_array(output.stats.overlap_sum))
      self.verified_positions += int(host_array(output.stats.verified_positions))
    if lengths:
      self._lengths.extend(host_array(output.output.lengths).tolist())

  @property
  def lengths(self) -> list[int]:
    """Every output length the decoder has seen (the calibration's, the run's), the
    plain decodes' read back first."""
    self._read_plain()
    return self._lengths

  @lengths.setter
  def lengths(self, value):
    self._lengths = list(value)

  @property
  def alpha(self) -> float:
    if self.verified_positions:
      return self.overlap_sum / self.verified_positions
    return 0.0 if self._alpha_prior is None else self._alpha_prior

  def load_calibration(self) -> bool:
    """The cached costs (and alpha, lengths as priors) for this key, where there are."""
    if self.cache is None or self.key is None:
      return False
    data = self.cache.load(self.key)
    if data is None:
      return False
    self.costs = BatchCosts.from_json(data['costs'])
    self._alpha_prior = float(data['alpha'])
    self.lengths = self.lengths or list(data['lengths'])
    return True

  def calibrate(self, batches: Sequence[Any], rounds: tuple[int, int] = CALIBRATION_ROUNDS,
                budget_seconds: float = CALIBRATION_SECONDS):
    """Measures the BatchCosts over `batches` (decoded once each untimed first, which
    compiles), interleaving the decoders so that load
    hits all alike; the fastest of rounds[0] to rounds[1] rounds (as many as
    budget_seconds of decoding holds). Saves them in the cache."""
    per_batch, outputs = self._time_candidates(batches, rounds, budget_seconds)
    for gamma, gamma_outputs in outputs.items():
      for output in gamma_outputs:  # lengths from the baseline's, alpha from the others'
        self._observe(gamma, output, lengths=gamma == 0)
    seconds = {g: sum(s) for g, s in per_batch.items()}
    plain = [(s, self._work(o)) for s, o in zip(per_batch[0], outputs[0])]
    speculative = {g: [(s, int(o.stats.target_calls), int(o.stats.draft_calls))
                       for s, o in zip(per_batch[g], outputs[g])] for g in self.gammas}
    self.costs = dataclasses.replace(
        fit_batch_costs(self.batch_size, plain, speculative),
        measured_speedup={g: seconds[0] / max(seconds[g], 1e-12) for g in self.gammas},
        alpha=self.alpha, lengths=tuple(self.lengths))
    if self.cache is not None and self.key is not None:
      self.cache.save(self.key, self.costs, self.alpha, self.lengths)

  def _record(self, gamma: int, output: SpeculativeOutput, seconds: float):
    """Keeps the batch's seconds by its rows' output lengths (`realized_ratios` compares
    them with what the model predicts for exactly those lengths)."""
    rows = tuple(sorted(host_array(output.output.lengths).tolist()))
    entry = self._batches.setdefault(gamma, {}).setdefault(rows, [0, 0.0])
    entry[0] += 1
    entry[1] += seconds

  def realized_ratios(self) -> dict[int, float]:
    """{gamma: predicted / realized seconds over the batches the run decoded with it}
    (above 1: faster than predicted) for each gamma that decoded REALIZED_BATCHES
    batches, at the running alpha, times the run's own baseline over the model's once the
    run has decoded PLAIN_STEPS baseline steps: how far each gamma runs off its
    prediction, whatever the lengths of the batches it happened to decode."""
    plain = 1.0  # the run's baseline over the model's, once it has run PLAIN_STEPS
    self._read_plain()
    if self._plain_steps >= self.PLAIN_STEPS:
      modelled = (self._plain_batches * self.costs.batch_seconds
                  + self._plain_steps * self.costs.step_seconds)
      plain = self._plain_seconds / max(modelled, 1e-12)
    ratios, scales = {}, calibration_scales(self.costs)
    for gamma, by_rows in self._batches.items():
      if sum(n for n, _ in by_rows.values()) < self.REALIZED_BATCHES:
        continue
      horizon = max(max(rows) for rows in by_rows)
      predicted = sum(
          n * predicted_batch_seconds(self.costs, self.alpha, gamma, rows, horizon, scales)
          for rows, (n, _) in by_rows.items())
      ratios[gamma] = plain * predicted / max(sum(s for _, s in by_rows.values()), 1e-12)
    return ratios

  def choose(self) -> int:
    """The gamma for the next batch: decided anew every `refresh_batches` batches (a
    decision simulates batches: milliseconds), with hysteresis around the one in use."""
    if self.costs is None:
      raise ValueError('AutoGammaDecoder has no costs: calibrate() or load_calibration() '
                       'first')
    if not (self._lengths or self._unread_plain) or not self.costs.call_seconds:
      return 0
    if self.current is None or self._since_decision >= self.refresh_batches:
      self.current = choose_gamma(self.costs, self.alpha, self.lengths, self.min_speedup,
                                  self.current, self.realized_ratios())
      self._since_decision = 0
    self._since_decision += 1
    return self.current


# ----------------------------------------------------------------------------------
# Speculative beam search: plain beam search where it cannot pay.

BEAM_GAMMAS = (1, 2, 3)  # speculative beam search's candidates (0: plain beam search)


def choose_measured(speedups: Mapping[int, float], min_speedup: float = MIN_SPEEDUP) -> int:
  """The gamma of the largest measured speedup if it is at least min_speedup, else 0."""
  best = max(speedups, key=lambda g: (speedups[g], -g), default=0)
  return best if best and speedups[best] >= min_speedup else 0


class AutoBeamDecoder(_ChoosingDecoder):
  """Speculative beam search with gamma chosen by measurement, 0 (plain beam search)
  included: its output is plain beam search's for any gamma, so only walltime depends
  on the choice.

  decode_beam(batch) -> BeamOutput and decode_speculative_beam(batch, spec) ->
  SpeculativeBeamOutput. `calibrate` times plain beam search and each gamma on the same
  batches; each gamma's speedup is then plain beam search's seconds a search step times
  the search steps over its seconds, measured there and, once a gamma has decoded
  REALIZED_BATCHES batches in the run, in the run itself.
  """

  def __init__(self, decode_beam: Callable, decode_speculative_beam: Callable,
               spec: SpeculativeBeamConfig, *, gammas: Sequence[int] = BEAM_GAMMAS,
               min_speedup: float = MIN_SPEEDUP):
    super().__init__(gammas, min_speedup)
    self.decode_beam, self.decode_speculative_beam = decode_beam, decode_speculative_beam
    self.spec = spec
    self.step_seconds: float | None = None  # plain beam search's seconds a search step
    self.measured: dict[int, float] = {}

  def spec_for(self, gamma: int) -> SpeculativeBeamConfig:
    return dataclasses.replace(self.spec, gamma=gamma)

  def _decoder(self, gamma: int) -> Callable:
    if gamma == 0:
      return lambda batch: as_speculative_beam_output(self.decode_beam(batch))
    return lambda batch: self.decode_speculative_beam(batch, self.spec_for(gamma))

  def _work(self, output: SpeculativeBeamOutput) -> int:
    return int(host_array(output.stats.steps))

  def _plain_reads(self, output: SpeculativeBeamOutput):
    return output.stats.target_calls  # [] one a search step

  def _count_plain(self, read: np.ndarray):
    self._plain_steps += int(read)

  def _calibrated_step_seconds(self) -> float:
    return self.step_seconds

  def calibrate(self, batches: Sequence[Any], rounds: tuple[int, int] = CALIBRATION_ROUNDS,
                budget_seconds: float = CALIBRATION_SECONDS):
    """Times plain beam search and each gamma over `batches` (compiled first),
    interleaved; the fastest of rounds[0] to rounds[1] rounds (as AutoGammaDecoder's)."""
    per_batch, outputs = self._time_candidates(batches, rounds, budget_seconds)
    seconds = {g: sum(s) for g, s in per_batch.items()}
    self.step_seconds = seconds[0] / max(sum(self._work(o) for o in outputs[0]), 1)
    self.measured = {g: seconds[0] / max(seconds[g], 1e-12) for g in self.gammas}

  def speedups(self) -> dict[int, float]:
    """Each gamma's speedup: the run's own where it decoded enough batches with it, the
    others' measurements scaled alike (`with_realized`)."""
    return with_realized(self.measured, self.realized_speedups())

  def choose(self) -> int:
    if self.step_seconds is None:
      raise ValueError('AutoBeamDecoder has no measurements: calibrate() first')
    return choose_measured(self.speedups(), self.min_speedup)
