"""gamma chosen per batch from measured costs: speculative decoding that never loses.

Every gamma is exact (at temperature 0 the output is the baseline's token for token, with
coupled verification its very draws, otherwise the target's distribution), so gamma is a
speed setting only, and which one pays depends on the batch size and the machine. On a
2-core CPU a verify step over b rows x (gamma + 1) positions is nearly free at b = 1 and
compute-bound by b = 8, where speculation with any gamma loses to the baseline; on an
accelerator the crossover sits elsewhere. gamma = 0 means the baseline itself.

The model. A batch decodes until its longest row ends.
  baseline:     time = steps x step_seconds,            steps = the longest row's tokens
  speculative:  time = iterations x iteration_seconds[g], iterations = the most any row takes
Each iteration of a row accepts its drafts up to the first rejection, each accepted with
probability alpha (the paper's i.i.d. model, Section 3.1), and adds one token.
E[iterations] and E[steps] come from simulating batches of the output lengths seen so far
(`expected_batch_iterations`); step_seconds and iteration_seconds[g] are measured on the
machine, for the pair and the batch size (`BatchCosts`, by `AutoGammaDecoder.calibrate`
from whole decodes, so the loop's own bookkeeping is in them), and alpha is the running
estimate (Corollary 3.6) over every speculative batch decoded so far.

As the run goes on it measures itself: the seconds of each batch against what the
baseline would have taken (its step cost times the batch's longest output) give the
speedup each gamma realizes, which replaces the prediction once a gamma has decoded a
few batches, so a gamma that does worse in the run than in the calibration is dropped.

`choose_gamma` is pure (a cost table and alpha in, gamma out); `AutoGammaDecoder` decodes
batches with it, measuring as it goes; `GammaCostCache` keeps calibrations in JSON files
keyed by machine, pair, dtype, platform and batch size, so a later run starts from them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.beam_search import BeamOutput
from jaxspec.decoding.common import DecodeOutput
from jaxspec.decoding.speculative_beam import (SpeculativeBeamConfig, SpeculativeBeamOutput,
                                               SpeculativeBeamStats)
from jaxspec.decoding.speculative import AUTO  # noqa: F401  (re-exported)
from jaxspec.decoding.speculative import SpeculativeConfig, SpeculativeOutput, SpeculativeStats

DEFAULT_GAMMAS = (1, 2, 3, 5, 9)  # gammas measured by calibration (gamma 0 always is)
# Speculation is chosen only where the model predicts at least this speedup: below it a
# prediction error would cost more than the gain.
MIN_SPEEDUP = 1.05
CACHE_DIR_ENV = 'JAXSPEC_CALIBRATION_DIR'


@dataclasses.dataclass
class BatchCosts:
  """Measured at one batch size: seconds per baseline step and per speculative iteration
  of each gamma (the decoder's whole time over the steps or iterations it ran).

  Where the costs come from whole decodes of real batches, `measured_speedup[g]` is the
  baseline's time over gamma g's on those same batches, at `alpha` with `lengths`: the
  model's prediction is scaled to agree with it there (`predicted_speedups`), so what
  the model leaves out (rows finishing apart, the first proposal, cache effects) is
  carried by the measurement and only the drift of alpha and lengths by the model."""
  batch_size: int
  step_seconds: float
  iteration_seconds: dict[int, float]
  measured_speedup: dict[int, float] = dataclasses.field(default_factory=dict)
  alpha: float | None = None  # over the measured batches
  lengths: tuple[int, ...] = ()  # output lengths of the measured batches

  def to_json(self) -> dict:
    return {'batch_size': self.batch_size, 'step_seconds': self.step_seconds,
            'iteration_seconds': {str(g): s for g, s in self.iteration_seconds.items()},
            'measured_speedup': {str(g): s for g, s in self.measured_speedup.items()},
            'alpha': self.alpha, 'lengths': list(self.lengths)}

  @classmethod
  def from_json(cls, data: Mapping[str, Any]) -> 'BatchCosts':
    return cls(batch_size=int(data['batch_size']), step_seconds=float(data['step_seconds']),
               iteration_seconds={int(g): float(s)
                                  for g, s in data['iteration_seconds'].items()},
               measured_speedup={int(g): float(s)
                                 for g, s in data.get('measured_speedup', {}).items()},
               alpha=data.get('alpha'), lengths=tuple(data.get('lengths', ())))


def row_iterations(lengths: np.ndarray, alpha: float, gamma: int,
                   rng: np.random.Generator) -> np.ndarray:
  """Iterations each row of lengths [...] (its tokens, EOS included) takes under the
  i.i.d. acceptance model: per iteration min(Geometric, gamma) accepted drafts plus one
  token. -> [...] int."""
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


def expected_batch_iterations(lengths: Sequence[int], alpha: float, gamma: int,
                              batch_size: int, samples: int = 512,
                              seed: int = 0) -> tuple[float, float]:
  """(E[baseline steps], E[speculative iterations]) of a batch of batch_size rows whose
  lengths are drawn from `lengths` (outputs seen, EOS included): the longest row's
  tokens, and the most iterations any row takes with `gamma` at `alpha`."""
  rng = np.random.default_rng(seed)
  drawn = rng.choice(np.asarray(lengths, np.int64), size=(samples, batch_size))
  steps = drawn.max(axis=1).mean()
  if gamma == 0:
    return float(steps), float(steps)
  return float(steps), float(row_iterations(drawn, alpha, gamma, rng).max(axis=1).mean())


def model_speedups(costs: BatchCosts, alpha: float, lengths: Sequence[int]
                   ) -> dict[int, float]:
  """{gamma: baseline time / speculative time} by the model alone (0: 1.0)."""
  speedups = {0: 1.0}
  for gamma, seconds in sorted(costs.iteration_seconds.items()):
    steps, iterations = expected_batch_iterations(lengths, alpha, gamma, costs.batch_size)
    speedups[gamma] = steps * costs.step_seconds / max(iterations * seconds, 1e-12)
  return speedups


def predicted_speedups(costs: BatchCosts, alpha: float, lengths: Sequence[int]
                       ) -> dict[int, float]:
  """{gamma: predicted speedup} at `alpha` with outputs of `lengths`: the model's, scaled
  by measured / modelled at the measurement's own alpha and lengths where the costs
  carry a measurement."""
  speedups = model_speedups(costs, alpha, lengths)
  if costs.measured_speedup and costs.alpha is not None and costs.lengths:
    at_measurement = model_speedups(costs, costs.alpha, costs.lengths)
    for gamma, measured in costs.measured_speedup.items():
      if gamma in speedups:
        speedups[gamma] *= measured / max(at_measurement[gamma], 1e-12)
  return speedups


def choose_gamma(costs: BatchCosts, alpha: float, lengths: Sequence[int],
                 min_speedup: float = MIN_SPEEDUP, current: int | None = None,
                 realized: Mapping[int, float] | None = None) -> int:
  """The gamma of the largest predicted speedup; 0 (the baseline) unless some gamma is
  predicted at least min_speedup. `realized` ({gamma: speedup}) overrides the
  prediction of the gammas the run itself has measured. With `current` (the gamma in
  use), a switch needs the new gamma predicted min_speedup times faster than it: each
  program compiles on first use, and flipping between near-equal choices would only pay
  compiles."""
  speedups = {**predicted_speedups(costs, alpha, lengths), **(realized or {})}
  best = max(speedups, key=lambda g: (speedups[g], -g))
  if not best or speedups[best] < min_speedup:
    return 0  # no gamma pays clearly: the baseline, whatever ran before
  if current and current in speedups and best != current:
    if speedups[best] < min_speedup * speedups[current]:
      return current
  return best


def as_speculative_output(output: DecodeOutput) -> SpeculativeOutput:
  """A baseline decode as a gamma-0 SpeculativeOutput: one target call a token (the
  batch's steps: its longest row), no drafts."""
  steps = jnp.max(output.lengths).astype(jnp.int32)
  zero = jnp.zeros((), jnp.int32)
  stats = SpeculativeStats(
      target_calls=steps, draft_calls=zero, row_target_calls=output.lengths.astype(jnp.int32),
      accepted_per_position=jnp.zeros((0,), jnp.int32),
      num_accepted_counts=jnp.zeros((1,), jnp.int32), overlap_sum=jnp.zeros((), jnp.float32),
      verified_positions=zero, num_drafted_counts=jnp.zeros((1,), jnp.int32),
      target_positions=steps * output.lengths.shape[0])
  return SpeculativeOutput(output=output, stats=stats)


def machine_description() -> dict:
  """What decode costs depend on beyond the model: the device, or the CPU's model and
  cores; the platform; jax's version."""
  device = jax.devices()[0]
  description = {'platform': jax.default_backend(), 'device': device.device_kind,
                 'devices': jax.device_count(), 'jax': jax.__version__}
  if jax.default_backend() == 'cpu':
    description.update(cpu=_cpu_model(), cores=os.cpu_count(), machine=platform.machine())
  return description


def _cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as cpuinfo:
      for line in cpuinfo:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or 'unknown'


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


def _timed(decode: Callable, batch):
  start = time.perf_counter()
  output = jax.block_until_ready(decode(batch))
  return output, time.perf_counter() - start


class AutoGammaDecoder:
  """Speculative decoding with gamma chosen per batch (0: the baseline), from costs
  measured for this batch size and the running alpha and output lengths.

  decode_baseline(batch) -> DecodeOutput and decode_speculative(batch, spec) ->
  SpeculativeOutput decode one batch (the caller's arrays: tokens, keys, placement);
  spec is `spec` with the chosen gamma (verify_lengths kept where they fit it).
  Calling the decoder returns a SpeculativeOutput whatever it chose (a baseline decode as
  gamma 0: `as_speculative_output`); `gamma_counts` says how often it chose each gamma.
  """

  def __init__(self, decode_baseline: Callable, decode_speculative: Callable,
               spec: SpeculativeConfig, *, batch_size: int,
               gammas: Sequence[int] = DEFAULT_GAMMAS, key: Mapping[str, Any] | None = None,
               cache: GammaCostCache | None = None, min_speedup: float = MIN_SPEEDUP,
               refresh_batches: int = 32):
    gammas = tuple(sorted(set(int(g) for g in gammas)))
    if not gammas or gammas[0] < 1:
      raise ValueError(f'auto gammas must be integers >= 1 (0, the baseline, is always '
                       f'a choice), got {gammas!r}')
    self.decode_baseline, self.decode_speculative = decode_baseline, decode_speculative
    self.spec, self.batch_size, self.gammas = spec, batch_size, gammas
    self.key = None if key is None else {**key, 'batch_size': batch_size, 'gammas': gammas}
    self.cache, self.min_speedup = cache, min_speedup
    self.costs: BatchCosts | None = None
    self.overlap_sum, self.verified_positions = 0.0, 0
    self.lengths: list[int] = []
    self.gamma_counts: dict[int, int] = {}
    self.current: int | None = None  # the gamma in use
    self.refresh_batches = refresh_batches
    self._since_decision = 0
    self._next: int | None = None  # decided by ready() for the next call
    self._compiled: set = set()  # (gamma, batch shapes) that have run
    # gamma -> [the baseline's seconds for its batches (step_seconds x their longest
    # output), their seconds with gamma, batches]: the speedup this run realized.
    self._realized: dict[int, list] = {}
    self._baseline_seconds, self._baseline_steps = 0.0, 0
    self._alpha_prior: float | None = None

  def spec_for(self, gamma: int) -> SpeculativeConfig:
    lengths = tuple(k for k in self.spec.verify_lengths if k <= gamma)
    return dataclasses.replace(self.spec, gamma=gamma, verify_lengths=lengths)

  @property
  def alpha(self) -> float:
    if self.verified_positions:
      return self.overlap_sum / self.verified_positions
    return 0.0 if self._alpha_prior is None else self._alpha_prior

  REALIZED_BATCHES = 4  # batches of a gamma before its realized speedup replaces the model's

  def realized_speedups(self) -> dict[int, float]:
    """{gamma: the baseline's predicted seconds over the seconds gamma took} for the gammas
    this run decoded REALIZED_BATCHES batches with (0: 1 by definition)."""
    return {g: baseline / max(seconds, 1e-12)
            for g, (baseline, seconds, batches) in self._realized.items()
            if g and batches >= self.REALIZED_BATCHES}

  def step_seconds(self) -> float:
    """The baseline's seconds per step: this run's own once it decoded 64 steps with it."""
    if self._baseline_steps >= 64:
      return self._baseline_seconds / self._baseline_steps
    return self.costs.step_seconds

  def _realize(self, gamma: int, seconds: float, output: SpeculativeOutput):
    steps = int(np.max(jax.device_get(output.output.lengths)))
    if gamma == 0:
      self._baseline_seconds += seconds
      self._baseline_steps += steps
      return
    entry = self._realized.setdefault(gamma, [0.0, 0.0, 0])
    entry[0] += self.step_seconds() * steps
    entry[1] += seconds
    entry[2] += 1

  def _observe(self, output: SpeculativeOutput, lengths: bool = True):
    stats = jax.device_get(output.stats)
    self.overlap_sum += float(stats.overlap_sum)
    self.verified_positions += int(stats.verified_positions)
    if lengths:
      self.lengths.extend(int(n) for n in jax.device_get(output.output.lengths))

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

  def calibrate(self, batches: Sequence[Any], repeats: int = 2):
    """Measures step_seconds and iteration_seconds[g] over `batches` (decoded once each
    untimed first, which compiles), interleaving the decoders so that load hits all
    alike; the fastest of `repeats` rounds. Saves them in the cache."""
    decoders = {0: self.decode_baseline}
    decoders.update({g: (lambda batch, g=g: self.decode_speculative(batch, self.spec_for(g)))
                     for g in self.gammas})
    for gamma, decode in decoders.items():
      for batch in batches:
        shapes = (gamma, tuple(jax.tree_util.tree_map(np.shape, batch)))
        if shapes not in self._compiled:
          jax.block_until_ready(decode(batch))
          self._compiled.add(shapes)
    best: dict[int, float] = {}
    totals = {g: np.inf for g in decoders}
    for repeat in range(repeats):
      seconds = {g: 0.0 for g in decoders}
      units = {g: 0 for g in decoders}
      for batch in batches:
        for gamma, decode in decoders.items():
          output, elapsed = _timed(decode, batch)
          seconds[gamma] += elapsed
          if gamma == 0:
            units[0] += int(jnp.max(output.lengths))
            if repeat == 0:
              self.lengths.extend(int(n) for n in jax.device_get(output.lengths))
          else:
            units[gamma] += int(output.stats.target_calls)
            if repeat == 0:
              self._observe(output, lengths=False)
      for gamma in decoders:
        best[gamma] = min(best.get(gamma, np.inf), seconds[gamma] / max(units[gamma], 1))
        totals[gamma] = min(totals[gamma], seconds[gamma])
    self.costs = BatchCosts(
        batch_size=self.batch_size, step_seconds=best[0],
        iteration_seconds={g: best[g] for g in self.gammas},
        measured_speedup={g: totals[0] / max(totals[g], 1e-12) for g in self.gammas},
        alpha=self.alpha, lengths=tuple(self.lengths))
    if self.cache is not None and self.key is not None:
      self.cache.save(self.key, self.costs, self.alpha, self.lengths)

  def choose(self) -> int:
    """The gamma for the next batch: decided anew every `refresh_batches` batches (a
    decision simulates batches: milliseconds), with hysteresis around the one in use."""
    if self.costs is None:
      raise ValueError('AutoGammaDecoder has no costs: calibrate() or load_calibration() '
                       'first')
    if not self.lengths or not self.costs.iteration_seconds:
      return 0
    if self.current is None or self._since_decision >= self.refresh_batches:
      self.current = choose_gamma(self.costs, self.alpha, self.lengths, self.min_speedup,
                                  self.current, self.realized_speedups())
      self._since_decision = 0
    self._since_decision += 1
    return self.current

  def ready(self, batch):
    """Decides the gamma for `batch` and, where that decoder has not yet run on a batch
    of its shapes, runs it once (it compiles), so that the timed call that follows
    decodes only. Callers that time each batch call it before the clock starts."""
    gamma = self._next = self.choose()
    shapes = (gamma, tuple(jax.tree_util.tree_map(np.shape, batch)))
    if shapes not in self._compiled:
      decode = (self.decode_baseline if gamma == 0 else
                lambda b: self.decode_speculative(b, self.spec_for(gamma)))
      jax.block_until_ready(decode(batch))
      self._compiled.add(shapes)

  def __call__(self, batch) -> SpeculativeOutput:
    gamma, self._next = (self.choose() if self._next is None else self._next), None
    self._compiled.add((gamma, tuple(jax.tree_util.tree_map(np.shape, batch))))
    self.gamma_counts[gamma] = self.gamma_counts.get(gamma, 0) + 1
    if gamma == 0:
      output, seconds = _timed(lambda b: as_speculative_output(self.decode_baseline(b)), batch)
      self.lengths.extend(int(n) for n in jax.device_get(output.output.lengths))
    else:
      output, seconds = _timed(lambda b: self.decode_speculative(b, self.spec_for(gamma)),
                               batch)
      self._observe(output)
    self._realize(gamma, seconds, output)
    return output


# ----------------------------------------------------------------------------------
# Speculative beam search: plain beam search where it cannot pay.

BEAM_GAMMAS = (1, 2, 3)  # speculative beam search's candidates (0: plain beam search)


def as_speculative_beam_output(output: BeamOutput) -> SpeculativeBeamOutput:
  """Plain beam search as a gamma-0 SpeculativeBeamOutput: one target call a search step,
  each advancing one step, no draft calls."""
  steps = jnp.asarray(output.steps, jnp.int32)
  return SpeculativeBeamOutput(output=output, stats=SpeculativeBeamStats(
      target_calls=steps, draft_calls=jnp.zeros((), jnp.int32),
      steps_per_call=jnp.zeros((2,), jnp.int32).at[1].set(steps)))


def choose_measured(speedups: Mapping[int, float], min_speedup: float = MIN_SPEEDUP) -> int:
  """The gamma of the largest measured speedup if it is at least min_speedup, else 0."""
  best = max(speedups, key=lambda g: (speedups[g], -g), default=0)
  return best if best and speedups[best] >= min_speedup else 0


class AutoBeamDecoder:
  """Speculative beam search with gamma chosen by measurement, 0 (plain beam search)
  included: its output is plain beam search's for any gamma, so only walltime depends
  on the choice.

  decode_beam(batch) -> BeamOutput and decode_speculative_beam(batch, spec) ->
  SpeculativeBeamOutput. `calibrate` times plain beam search and each gamma on the same
  batches; each gamma's speedup is then plain beam search's seconds a search step times
  the search steps over its seconds, measured there and, once a gamma has decoded
  REALIZED_BATCHES batches in the run, in the run itself.
  """

  REALIZED_BATCHES = AutoGammaDecoder.REALIZED_BATCHES

  def __init__(self, decode_beam: Callable, decode_speculative_beam: Callable,
               spec: SpeculativeBeamConfig, *, gammas: Sequence[int] = BEAM_GAMMAS,
               min_speedup: float = MIN_SPEEDUP):
    self.decode_beam, self.decode_speculative_beam = decode_beam, decode_speculative_beam
    self.spec, self.gammas, self.min_speedup = spec, tuple(sorted(set(gammas))), min_speedup
    if not self.gammas or self.gammas[0] < 1:
      raise ValueError(f'auto gammas must be integers >= 1, got {gammas!r}')
    self.step_seconds: float | None = None  # plain beam search's seconds a search step
    self.measured: dict[int, float] = {}
    self._realized: dict[int, list] = {}  # gamma -> [plain seconds, seconds, batches]
    self.gamma_counts: dict[int, int] = {}
    self._compiled: set = set()
    self._next: int | None = None

  def spec_for(self, gamma: int) -> SpeculativeBeamConfig:
    return dataclasses.replace(self.spec, gamma=gamma)

  def _decoder(self, gamma: int) -> Callable:
    if gamma == 0:
      return lambda batch: as_speculative_beam_output(self.decode_beam(batch))
    return lambda batch: self.decode_speculative_beam(batch, self.spec_for(gamma))

  def _compile(self, gamma: int, batch):
    shapes = (gamma, tuple(jax.tree_util.tree_map(np.shape, batch)))
    if shapes not in self._compiled:
      jax.block_until_ready(self._decoder(gamma)(batch))
      self._compiled.add(shapes)

  def calibrate(self, batches: Sequence[Any], repeats: int = 2):
    """Times plain beam search and each gamma over `batches` (compiled first),
    interleaved; the fastest of `repeats` rounds."""
    candidates = (0,) + self.gammas
    for gamma in candidates:
      for batch in batches:
        self._compile(gamma, batch)
    totals = {g: np.inf for g in candidates}
    steps = 0
    for repeat in range(repeats):
      seconds = {g: 0.0 for g in candidates}
      for batch in batches:
        for gamma in candidates:
          output, elapsed = _timed(self._decoder(gamma), batch)
          seconds[gamma] += elapsed
          if gamma == 0 and repeat == 0:
            steps += int(output.output.steps)
      totals = {g: min(totals[g], seconds[g]) for g in candidates}
    self.step_seconds = totals[0] / max(steps, 1)
    self.measured = {g: totals[0] / max(totals[g], 1e-12) for g in self.gammas}

  def speedups(self) -> dict[int, float]:
    """Each gamma's speedup: the run's own where it decoded enough batches with it."""
    realized = {g: plain / max(seconds, 1e-12)
                for g, (plain, seconds, batches) in self._realized.items()
                if batches >= self.REALIZED_BATCHES}
    return {**self.measured, **realized}

  def choose(self) -> int:
    if self.step_seconds is None:
      raise ValueError('AutoBeamDecoder has no measurements: calibrate() first')
    return choose_measured(self.speedups(), self.min_speedup)

  def ready(self, batch):
    """Decides the gamma for `batch` and compiles it for the batch's shapes, so the timed
    call that follows decodes only."""
    self._next = self.choose()
    self._compile(self._next, batch)

  def __call__(self, batch) -> SpeculativeBeamOutput:
    gamma, self._next = (self.choose() if self._next is None else self._next), None
    self.gamma_counts[gamma] = self.gamma_counts.get(gamma, 0) + 1
    output, seconds = _timed(self._decoder(gamma), batch)
    if gamma:
      entry = self._realized.setdefault(gamma, [0.0, 0.0, 0])
      entry[0] += self.step_seconds * int(output.stats.steps)
      entry[1] += seconds
      entry[2] += 1
    return output

