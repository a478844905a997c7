"""What a target decode step over k positions costs against a one-position step.

Theorem 3.8 takes a verify step over gamma + 1 positions to cost one step. This module
measures V(k) = time(step over k positions) / time(step over 1 position) for a target,
in each variant of the decode matmuls (VARIANTS: the kernel layout of
jaxspec.model.cpu.layout and T5Config.cpu_matmul), with every (variant, k) timed in
turn within each repetition so that machine load hits all of them alike; plus the
FLOPs and bytes XLA's cost analysis assigns to each compiled step, and the fraction
of this machine's measured memory bandwidth and matmul throughput the step reaches.
`measure_int8_draft_cost` gives c of Theorem 3.8 for the target's int8 draft (its own
decoder in int8, jaxspec.Int8Drafter): the cost that sets which target sizes speculation
pays for on a CPU, where a step reads every weight of the decoder once.

Used by scripts/step_costs.py; nothing here parses flags or writes files.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.measure import benchmark
from jaxspec.config import T5Config
from jaxspec.decoding.drafters.base import DraftContext
from jaxspec.decoding.drafters.feature import FeatureDrafter, FeatureDrafterWithTarget
from jaxspec.decoding.drafters.int8 import Int8Drafter
from jaxspec.decoding.drafters.shared_encoder import SharedEncoderDrafterWithTarget
from jaxspec.model import T5, feature_draft, init_params, rollback
from jaxspec.model.cpu import layout as kernel_layout
from jaxspec.sampling import SamplingConfig, argmax


# Variant name -> (kernel layout, T5Config.cpu_matmul).
VARIANTS: dict[str, tuple[str, str]] = {
    't5x': (kernel_layout.T5X, 'xla'),  # kernel [in, out], XLA's dot
    'transposed': (kernel_layout.TRANSPOSED, 'xla'),  # kernel_t [out, in], XLA's einsum
    'kernel': (kernel_layout.TRANSPOSED, 'kernel'),  # kernel_t through the few-row kernel
    # kernel_tiles [out / 16, in, 16] through the few-row kernel: the CPU's decode layout
    # where the kernel's AVX-512 build runs, and measured only there (variants_here).
    'tiled': (kernel_layout.TILED, 'kernel'),
}


def variants_here() -> tuple[str, ...]:
  """The VARIANTS this machine runs as they are meant: all but 'tiled' where the
  kernel's tiled form does not run (elsewhere tiles would go through XLA's einsum)."""
  return tuple(name for name in VARIANTS
               if name != 'tiled' or kernel_layout.decode_layout('cpu') == kernel_layout.TILED)


def decode_variant() -> str:
  """The variant in the CPU's decode layout here (kernel_layout.decode_layout): 'tiled'
  where the AVX-512 build runs, else 'kernel'."""
  return 'tiled' if 'tiled' in variants_here() else 'kernel'


def variant(params, config: T5Config, name: str):
  """(params, config) of a variant: params in its layout, config with its cpu_matmul."""
  layout, cpu_matmul = VARIANTS[name]
  return kernel_layout.to_layout(params, layout), config.replace(cpu_matmul=cpu_matmul)


@dataclasses.dataclass(frozen=True)
class StepCostSetup:
  """Where the steps run: one row, a cache holding `cache_position` decoder positions."""
  batch_size: int = 1
  source_length: int = 40
  cache_position: int = 20
  cache_length: int = 64
  steps_per_call: int = 10  # Decode steps per timed call (one jit, a fori_loop).
  repeats: int = 15


@functools.partial(jax.jit, static_argnames=('config', 'num_steps', 'cache_position'))
def _decode_steps(params, cache, tokens, *, config: T5Config, num_steps: int,
                  cache_position: int):
  """num_steps decode steps of tokens [b, k], each from the same cache position."""
  model = T5(config)
  batch = tokens.shape[0]

  def step(_, carry):
    cache, tokens = carry
    cache = rollback(cache, jnp.full((batch,), cache_position, jnp.int32))
    logits, cache = model.apply(params, tokens, cache, method=T5.decode)  # [b, k, v]
    # The next inputs depend on the logits, so no step can be skipped or hoisted.
    # The decoders' argmax (two single-output reductions): XLA's fused (value, index)
    # reduction would add ~0.2-0.6 ms a step at batch 4 that no decoder pays.
    return cache, argmax(logits)

  return jax.lax.fori_loop(0, num_steps, step, (cache, tokens))[1]


def _one_step(params, cache, tokens, *, config: T5Config, cache_position: int):
  cache = rollback(cache, jnp.full((tokens.shape[0],), cache_position, jnp.int32))
  return T5(config).apply(params, tokens, cache, method=T5.decode)[0]


def step_cost_analysis(params, cache, tokens, config: T5Config,
                       cache_position: int) -> dict[str, float]:
  """{'flops', 'bytes'} XLA's cost analysis gives one compiled decode step.

  XLA does not count what runs in a custom call, so the step is analysed with XLA's
  matmuls (cpu_matmul 'xla'): the few-row kernel does the same arithmetic.
  """
  config = config.replace(cpu_matmul='xla')
  compiled = jax.jit(functools.partial(_one_step, config=config,
                                       cache_position=cache_position)).lower(
                                           params, cache, tokens).compile()
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  analysis = analysis or {}
  return {'flops': float(analysis.get('flops', float('nan'))),
          'bytes': float(analysis.get('bytes accessed', float('nan')))}


def _empty_cache(params, config: T5Config, setup: StepCostSetup):
  model = T5(config)
  encoder_tokens = jnp.ones((setup.batch_size, setup.source_length), jnp.int32)
  encoded = model.apply(params, encoder_tokens, method=T5.encode)
  return model.apply(params, encoded, encoder_tokens, setup.cache_length, method=T5.init_cache)


def interleaved_times(calls: Mapping[str, Callable[[], jax.Array]],
                      repeats: int) -> dict[str, np.ndarray]:
  """{name: seconds of each repetition}: every call once untimed, then all in turn
  (benchmark.time_side_by_side over a single item)."""
  totals = benchmark.time_side_by_side({name: lambda _, call=call: call()
                                        for name, call in calls.items()}, 1, repeats)
  return {name: np.asarray(seconds) for name, seconds in totals.items()}


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """One target's step costs in each variant."""
  step_seconds: dict[str, dict[int, float]]  # variant -> k -> fastest seconds per step
  ratio: dict[str, dict[int, float]]  # variant -> k -> V(k): median over repetitions
  cost: dict[str, dict[int, dict[str, float]]]  # variant -> k -> {'flops', 'bytes'}


def measure_step_costs(config: T5Config, positions: Sequence[int],
                       variants: Sequence[str] | None = None,
                       setup: StepCostSetup = StepCostSetup(), params=None,
                       seed: int = 0) -> StepCosts:
  """V(k) for k in `positions` (1 is added), per variant (default: variants_here()),
  interleaved in one process.

  params: the target's variables (random ones of `config` by default; the values do
  not change the cost of a step).
  """
  if params is None:
    params = {'params': init_params(config, jax.random.PRNGKey(seed))['params']}
  positions = sorted(set(positions) | {1})
  variants = variants_here() if variants is None else tuple(variants)
  calls, inputs = {}, {}
  for name in variants:
    variant_params, variant_config = variant(params, config, name)
    cache = _empty_cache(variant_params, variant_config, setup)
    for k in positions:
      tokens = jnp.ones((setup.batch_size, k), jnp.int32)
      inputs[name, k] = (variant_params, cache, tokens, variant_config)
      calls[name, k] = functools.partial(
          _decode_steps, variant_params, cache, tokens, config=variant_config,
          num_steps=setup.steps_per_call, cache_position=setup.cache_position)
  times = interleaved_times(calls, setup.repeats)
  step_seconds, ratio, cost = {}, {}, {}
  for name in variants:
    one = times[name, 1]
    step_seconds[name] = {k: float(times[name, k].min()) / setup.steps_per_call
                          for k in positions}
    ratio[name] = {k: float(np.median(times[name, k] / one)) for k in positions}
    cost[name] = {k: step_cost_analysis(*inputs[name, k], setup.cache_position)
                  for k in positions}
  return StepCosts(step_seconds=step_seconds, ratio=ratio, cost=cost)


@dataclasses.dataclass(frozen=True)
class Int8DraftCost:
  """A target's int8 draft against the target's steps (in the `target_variant`, the
  CPU's decode layout: decode_variant()); seconds are medians over repetitions."""
  gamma: int
  step_seconds: float  # the target's one-position step
  verify_seconds: float  # the target's step over gamma + 1 positions
  proposal_seconds: float  # one proposal of gamma int8-draft tokens
  # One proposal followed by one verify step, in a loop: more than the two apart when
  # the draft's and the target's weights evict each other from the cache.
  iteration_seconds: float
  c: float  # median over repetitions of proposal / (gamma x step)
  # A feature-level head of `feature_layers` decoder layers over the same target
  # (jaxspec.FeatureDrafter, int8 as the int8 draft), timed in the same rounds; None when
  # not measured.
  feature_layers: int = 0
  feature_proposal_seconds: float | None = None
  feature_c: float | None = None
  target_variant: str = 'kernel'

  @property
  def interference_seconds(self) -> float:
    """What an iteration costs beyond its proposal and verify step timed apart."""
    return self.iteration_seconds - self.proposal_seconds - self.verify_seconds


# Proposals (or iterations) per timed call; their difference times them without the
# drafter's setup (the target's encoder pass), which both calls run once.
INT8_PROPOSAL_CALLS = (2, 10)


@functools.partial(jax.jit, static_argnames=('drafter', 'target_config', 'gamma',
                                             'cache_length', 'cache_position'))
def _iterations(params, encoder_tokens, tokens, num_iterations, *, drafter,
                target_config: T5Config, gamma: int, cache_length: int, cache_position: int):
  """num_iterations (traced) of a greedy proposal of gamma tokens by `drafter` (params
  {'draft', 'target'}) and the target's step over the last input and the drafts, as
  speculative decoding alternates them; each iteration is fed the one before."""
  model = T5(target_config)
  batch = encoder_tokens.shape[0]
  encoded = model.apply(params['target'], encoder_tokens, method=T5.encode)
  # One encoder pass for both, as in speculative decoding.
  state = drafter.init_state_from_target(params, encoder_tokens, encoded, cache_length)
  cache = model.apply(params['target'], encoded, encoder_tokens, cache_length,
                      method=T5.init_cache)
  keys = jax.random.split(jax.random.PRNGKey(0), batch)
  length = jnp.full((batch,), cache_position, jnp.int32)

  def iteration(_, carry):
    state, cache, tokens = carry
    context = DraftContext(tokens=tokens, length=length, encoder_tokens=encoder_tokens)
    drafts, _, state = drafter.propose(params, state, context, gamma, SamplingConfig(), keys)
    verify_tokens = jnp.concatenate([context.last_input()[:, None], drafts], axis=1)
    logits, cache = model.apply(params['target'], verify_tokens, rollback(cache, length),
                                method=T5.decode)  # [b, g+1, v]
    # The next proposal starts from this verify step's last token (x_length), so each
    # iteration waits for the one before, as in speculative decoding.
    token = argmax(logits[:, -1])
    return state, cache, tokens.at[:, cache_position - 1].set(token)

  return jax.lax.fori_loop(0, num_iterations, iteration, (state, cache, tokens))[2]


def measure_int8_draft_cost(config: T5Config, gamma: int,
                            setup: StepCostSetup = StepCostSetup(), params=None,
                            seed: int = 0, feature_layers: int = 0) -> Int8DraftCost:
  """The target's int8 draft (jaxspec.Int8Drafter: the target's decoder with int8
  weights over the target's encoding) against the target in the CPU's decode layout
  (decode_variant()), all through the few-row kernel and interleaved: the target's steps
  over 1 and gamma + 1 positions, greedy proposals of gamma tokens, and iterations of a
  proposal and a verify step; c of Theorem 3.8 from the first and the proposals. With
  feature_layers > 0, the proposals of a feature-level head of that many layers in int8
  (random weights: a step's cost does not depend on them) in the same rounds, and its c.

  params: the target's variables (random ones of `config` by default).
  """
  if gamma < 1:
    raise ValueError(f'gamma must be >= 1, got {gamma}')
  if setup.cache_position < 1:
    raise ValueError(f'cache_position must be >= 1 (the drafts follow a committed token), '
                     f'got {setup.cache_position}')
  if setup.cache_length <= setup.cache_position + gamma + 1:
    raise ValueError(f'cache_length {setup.cache_length} must exceed cache_position '
                     f'{setup.cache_position} + gamma + 1 = {setup.cache_position + gamma + 1}')
  if params is None:
    params = {'params': init_params(config, jax.random.PRNGKey(seed))['params']}
  target_variant = decode_variant()
  target_params, target_config = variant(params, config, target_variant)
  drafter = Int8Drafter(config=target_config)
  standalone = SharedEncoderDrafterWithTarget(drafter, target_config)
  both = {'draft': drafter.draft_params(target_params), 'target': target_params}
  encoder_tokens = jnp.ones((setup.batch_size, setup.source_length), jnp.int32)
  prefix = jnp.ones((setup.batch_size, setup.cache_length - gamma), jnp.int32)
  cache = _empty_cache(target_params, target_config, setup)
  calls = {}
  for name, positions in (('step', 1), ('verify', gamma + 1)):
    calls[name] = functools.partial(
        _decode_steps, target_params, cache, jnp.ones((setup.batch_size, positions), jnp.int32),
        config=target_config, num_steps=setup.steps_per_call,
        cache_position=setup.cache_position)
  for count in INT8_PROPOSAL_CALLS:
    calls['proposals', count] = functools.partial(
        benchmark.propose_calls, both, encoder_tokens, prefix, count, drafter=standalone,
        gamma=gamma, cache_length=setup.cache_length, sampling=SamplingConfig())
    calls['iterations', count] = functools.partial(
        _iterations, both, encoder_tokens, prefix, count, drafter=standalone,
        target_config=target_config, gamma=gamma, cache_length=setup.cache_length,
        cache_position=setup.cache_position)
  if feature_layers:
    head = FeatureDrafter(target_config, num_layers=feature_layers, weights='int8')
    head_params = feature_draft.init_params(head.head_config, jax.random.PRNGKey(seed + 1))
    feature = {'draft': FeatureDrafter.make_params(head_params, target_params, 'int8'),
               'target': target_params}
    for count in INT8_PROPOSAL_CALLS:
      calls['feature', count] = functools.partial(
          benchmark.propose_calls, feature, encoder_tokens, prefix, count,
          drafter=FeatureDrafterWithTarget(head, target_config), gamma=gamma,
          cache_length=setup.cache_length, sampling=SamplingConfig())
  times = interleaved_times(calls, setup.repeats)
  short, long = INT8_PROPOSAL_CALLS
  per_call = lambda name: (times[name, long] - times[name, short]) / (long - short)  # noqa: E731
  proposal, step = per_call('proposals'), times['step'] / setup.steps_per_call
  median = lambda x: float(np.median(x))  # noqa: E731
  feature = per_call('feature') if feature_layers else None
  return Int8DraftCost(gamma=gamma, step_seconds=median(step),
                       verify_seconds=median(times['verify'] / setup.steps_per_call),
                       proposal_seconds=median(proposal),
                       iteration_seconds=median(per_call('iterations')),
                       c=median(proposal / (gamma * step)), feature_layers=feature_layers,
                       feature_proposal_seconds=None if feature is None else median(feature),
                       feature_c=None if feature is None else median(feature / (gamma * step)),
                       target_variant=target_variant)


# ---------------------------------------------------------------------------
# This machine's roofline, measured.


@jax.jit
def _sum_rows(x):
  return jnp.sum(x, axis=0)


@jax.jit
def _matmul(a, b):
  return a @ b


def machine_roofline(megabytes: int = 256, matmul_size: int = 1024,
                     repeats: int = 5) -> dict[str, float]:
  """{'bytes_per_second', 'flops_per_second'}: a streaming sum over a buffer larger than
  any cache, and a square float32 matmul, each the fastest of `repeats`."""
  x = jnp.ones((megabytes * 2**20 // 4 // 1024, 1024), jnp.float32)
  a = jnp.ones((matmul_size, matmul_size), jnp.float32)
  read = interleaved_times({'read': lambda: _sum_rows(x)}, repeats)['read'].min()
  multiply = interleaved_times({'matmul': lambda: _matmul(a, a)}, repeats)['matmul'].min()
  return {'bytes_per_second': x.nbytes / float(read),
          'flops_per_second': 2 * matmul_size**3 / float(multiply)}
