"""Measurements behind the paper's tables: acceptance rates, step costs, walltimes.

Used by scripts/benchmark.py; nothing here parses gin or writes files.

- `measured_alpha`: alpha (Corollary 3.6) as the mean over the target's own outputs of
  beta = sum_x min(p, q), with p and q taken teacher forced at the same prefixes.
- `decode_step_seconds`, `propose_seconds`: the device time of one cached target
  decode step of k positions and of one drafter proposal, from the slope between two
  loop lengths (so launch and compile costs cancel out).
- `time_side_by_side`: several decoders over the same inputs, interleaved example by
  example, repeated; each repetition's total.
- `compare_verification_options`: tokens per target call, alpha, drafts accepted /
  proposed per iteration and walltime (interleaved, against plain speculative decoding
  and the baseline) for plain, block, adaptive-gamma and multi-draft speculative
  decoding over the same inputs and keys.
- `t5x_style_generate`: a reference decoder as T5X runs T5, one token per step with
  the cross-attention keys and values projected from the encoder output at every step.
- `beam_comparison`: target calls, steps per call and agreement (tokens, scores) of
  speculative beam search against beam search over the same examples.

Timings wait for the device (block_until_ready) and never include compilation: each
function runs once before its clock starts.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import inference
from jaxspec.config import EOS_ID, T5Config
from jaxspec.decoding import baseline, common
from jaxspec.decoding.drafters.base import DraftContext, Drafter
from jaxspec.decoding.speculative import SpeculativeConfig
from jaxspec.decoding.drafters.shared_encoder import SharedEncoderDrafterWithTarget
from jaxspec.decoding.drafters.t5 import T5Drafter
from jaxspec.model import T5, rollback
from jaxspec.sampling import SamplingConfig, standardize
from jaxspec.decoding.verification.token import acceptance_rate


# ---------------------------------------------------------------------------
# Acceptance rate alpha, teacher forced.


def shift_right(tokens):
  """tokens [b, t] -> decoder inputs [b, t]: the start token 0, then tokens[:, :-1]."""
  return jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]


@functools.partial(jax.jit, static_argnames=('config', 'sampling', 'with_raw'))
def _t5_teacher_forced(params, encoder_tokens, decoder_tokens, *, config: T5Config,
                       sampling: SamplingConfig, with_raw: bool = False):
  """Standardized probs [b, t, v] of a T5 at every prefix, and (with_raw) its softmax."""
  logits = T5(config).apply(params, encoder_tokens, shift_right(decoder_tokens))
  logits = logits.astype(jnp.float32)
  raw = jax.nn.softmax(logits, axis=-1) if with_raw else None
  return standardize(logits, sampling), raw


@functools.partial(jax.jit, static_argnames=('drafter', 'sampling'))
def _shared_encoder_teacher_forced(params, encoder_tokens, decoder_tokens, *,
                                   drafter: SharedEncoderDrafterWithTarget,
                                   sampling: SamplingConfig):
  """Standardized probs [b, t, v] of a shared-encoder draft at every prefix."""
  logits = drafter.teacher_forced_logits(params, encoder_tokens, shift_right(decoder_tokens))
  return standardize(logits.astype(jnp.float32), sampling)


@functools.partial(jax.jit, static_argnames=('drafter', 'sampling'))
def _per_prefix_proposals(params, encoder_tokens, decoder_tokens, key, *, drafter: Drafter,
                          sampling: SamplingConfig):
  """q [b, t, v] of a drafter whose proposal depends only on the committed prefix.

  Each prefix becomes its own row: row (b, j) has committed tokens[:j] and proposes one
  token (row (b, 0) after the start token alone, as a decode's first proposal).
  """
  batch, length = decoder_tokens.shape
  prefix_lengths = jnp.arange(length)  # [t]
  keep = jnp.arange(length)[None, :] < prefix_lengths[:, None]  # [t, t]
  rows = jnp.where(keep[None], decoder_tokens[:, None, :], 0).reshape(batch * length, length)
  context = DraftContext(tokens=rows, length=jnp.tile(prefix_lengths, batch),
                         encoder_tokens=jnp.repeat(encoder_tokens, length, axis=0))
  state = drafter.init_state(params, context.encoder_tokens, length + 1)
  keys = jax.random.split(key, batch * length)
  _, probs, _ = drafter.propose(params, state, context, 1, sampling, keys)
  return probs[:, 0].reshape(batch, length, -1)


def drafter_probs(drafter: Drafter, params, encoder_tokens, decoder_tokens,
                  sampling: SamplingConfig, key=None):
  """q [b, t, v]: what the drafter proposes for tokens[:, j] given tokens[:, :j].

  A T5 drafter and a (stand-alone) shared-encoder drafter run teacher forced; any other
  drafter must depend only on the prefix (true of the n-gram and prompt-lookup
  drafters) and is asked once per prefix.
  """
  if isinstance(drafter, T5Drafter):
    return _t5_teacher_forced(params, encoder_tokens, decoder_tokens, config=drafter.config,
                              sampling=sampling)[0]
  if isinstance(drafter, SharedEncoderDrafterWithTarget):
    return _shared_encoder_teacher_forced(params, encoder_tokens, decoder_tokens,
                                          drafter=drafter, sampling=sampling)
  key = jax.random.PRNGKey(0) if key is None else key
  return _per_prefix_proposals(params, encoder_tokens, decoder_tokens, key, drafter=drafter,
                               sampling=sampling)


@dataclasses.dataclass(frozen=True)
class TargetSamples:
  """The target's own outputs and its distributions at every prefix of them."""
  encoder_tokens: np.ndarray  # [n, s]
  tokens: np.ndarray  # [n, t] sampled from the target, 0 after EOS
  mask: np.ndarray  # [n, t] bool: every output position up to and including EOS
  batches: tuple[tuple[int, int], ...]  # [start, stop) row ranges used for scoring


def sample_target_outputs(target_params, target_config: T5Config, encoder_tokens,
                          max_decode_length: int, sampling: SamplingConfig, rng,
                          min_tokens: int, batch_size: int = 16) -> TargetSamples:
  """Decodes rows of encoder_tokens [n, s] with the target until >= min_tokens positions.

  Counts the positions speculative decoding drafts: every output position through EOS
  (the first too: no target call runs without drafts).
  """
  outputs, masks, batches, counted, start = [], [], [], 0, 0
  while counted < min_tokens and start < len(encoder_tokens):
    stop = min(start + batch_size, len(encoder_tokens))
    rows = _pad_to(np.asarray(encoder_tokens[start:stop]), batch_size)  # One compiled shape.
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.arange(start, start + batch_size))
    output = baseline.generate(target_params, rows, keys, config=target_config,
                               max_decode_length=max_decode_length, sampling=sampling)
    lengths = np.asarray(output.lengths)[:stop - start]
    positions = np.arange(max_decode_length)[None, :]
    mask = positions < lengths[:, None]
    outputs.append(np.asarray(output.tokens)[:stop - start])
    masks.append(mask)
    batches.append((start, stop))
    counted += int(mask.sum())
    start = stop
  return TargetSamples(encoder_tokens=np.asarray(encoder_tokens[:start]),
                       tokens=np.concatenate(outputs), mask=np.concatenate(masks),
                       batches=tuple(batches))


@dataclasses.dataclass(frozen=True)
class AlphaMeasurement:
  alpha: float  # mean beta over the counted positions
  positions: int  # how many positions were averaged
  alpha_by_lenience: Mapping[float, float]


def measured_alpha(samples: TargetSamples, target_params, target_config: T5Config,
                   drafter: Drafter, drafter_params, sampling: SamplingConfig,
                   lenience: Sequence[float] = (1.0,), batch_size: int = 16) -> AlphaMeasurement:
  """alpha = E(beta) over the target's outputs (Corollary 3.6), per lenience (A.5)."""
  return measured_alphas(samples, target_params, target_config,
                         {'drafter': (drafter, drafter_params)}, sampling, lenience,
                         batch_size)['drafter']


def measured_alphas(samples: TargetSamples, target_params, target_config: T5Config,
                    drafters: Mapping[str, tuple[Drafter, Any]], sampling: SamplingConfig,
                    lenience: Sequence[float] = (1.0,),
                    batch_size: int = 16) -> dict[str, AlphaMeasurement]:
  """`measured_alpha` of each {name: (drafter, params)}, scoring the target once per batch."""
  sums = {name: {l: 0.0 for l in lenience} for name in drafters}
  count = 0
  with_raw = sampling.is_greedy and min(lenience) < 1.0
  for start, stop in samples.batches:
    encoder_tokens = _pad_to(samples.encoder_tokens[start:stop], batch_size)
    tokens = _pad_to(samples.tokens[start:stop], batch_size)
    mask = samples.mask[start:stop]
    target_probs, raw_target_probs = _t5_teacher_forced(
        target_params, encoder_tokens, tokens, config=target_config, sampling=sampling,
        with_raw=with_raw)
    for name, (drafter, params) in drafters.items():
      draft_probs = drafter_probs(drafter, params, encoder_tokens, tokens, sampling)
      for l in lenience:
        raw = raw_target_probs if sampling.is_greedy and l < 1.0 else None
        beta = np.asarray(acceptance_rate(target_probs, draft_probs, l, raw))[:stop - start]
        sums[name][l] += float(beta[mask].sum())
    count += int(mask.sum())
  results = {}
  for name in drafters:
    by_lenience = {l: sums[name][l] / max(count, 1) for l in lenience}
    results[name] = AlphaMeasurement(alpha=by_lenience[lenience[0]], positions=count,
                                     alpha_by_lenience=by_lenience)
  return results


def _pad_to(rows: np.ndarray, batch_size: int) -> np.ndarray:
  """rows [n, ...] -> [batch_size, ...], repeating the last row (padding rows are real)."""
  return np.pad(rows, ((0, batch_size - len(rows)),) + ((0, 0),) * (rows.ndim - 1), mode='edge')


# ---------------------------------------------------------------------------
# Device time of one step, from the slope between two loop lengths.


def fastest_seconds(fn: Callable[[], Any], repeats: int) -> float:
  """Least walltime of fn() over repeats (device work waited for), after one untimed run.

  The least, not the median: other load on the machine only ever adds time.
  """
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.min(times))


def _slope(run: Callable[[int], Any], short: int, long: int, repeats: int) -> float:
  """Seconds per iteration of run(n), from n = short and n = long."""
  return ((fastest_seconds(lambda: run(long), repeats)
           - fastest_seconds(lambda: run(short), repeats)) / (long - short))


@functools.partial(jax.jit, static_argnames=('config', 'tokens_per_step', 'cache_length'))
def _decode_steps(params, encoder_tokens, num_steps, *, config: T5Config, tokens_per_step: int,
                  cache_length: int):
  """Runs num_steps (traced: one compile for every count) cached decode steps."""
  model = T5(config)
  encoded = model.apply(params, encoder_tokens, method=T5.encode)
  cache = model.apply(params, encoded, encoder_tokens, cache_length, method=T5.init_cache)
  batch = encoder_tokens.shape[0]
  span = cache_length - tokens_per_step + 1

  def step(i, carry):
    cache, tokens = carry
    cache = rollback(cache, jnp.full((batch,), i % span, jnp.int32))
    logits, cache = model.apply(params, tokens, cache, method=T5.decode)  # [b, k, v]
    # The next inputs depend on the logits, so no step can be skipped or hoisted.
    return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)

  tokens = jnp.ones((batch, tokens_per_step), jnp.int32)
  return jax.lax.fori_loop(0, num_steps, step, (cache, tokens))[1]


def decode_step_seconds(params, config: T5Config, encoder_tokens, tokens_per_step: int,
                        cache_length: int, steps: tuple[int, int] = (8, 40),
                        repeats: int = 5) -> float:
  """Seconds of one cached decode step of `tokens_per_step` positions per row."""
  run = lambda n: _decode_steps(params, encoder_tokens, n, config=config,
                                tokens_per_step=tokens_per_step, cache_length=cache_length)
  return _slope(run, *steps, repeats)


@functools.partial(jax.jit, static_argnames=('drafter', 'gamma', 'cache_length', 'sampling'))
def propose_calls(params, encoder_tokens, tokens, num_calls, *, drafter: Drafter, gamma: int,
                  cache_length: int, sampling: SamplingConfig):
  """Runs num_calls (traced) proposals, each fed the drafts of the one before."""
  batch = encoder_tokens.shape[0]
  state = drafter.init_state(params, encoder_tokens, cache_length)
  keys = jax.random.split(jax.random.PRNGKey(0), batch)

  def call(i, carry):
    state, tokens = carry
    length = jnp.full((batch,), 1 + i % (tokens.shape[1] - gamma), jnp.int32)
    context = DraftContext(tokens=tokens, length=length, encoder_tokens=encoder_tokens)
    drafts, _, state = drafter.propose(params, state, context, gamma, sampling, keys)
    # Feed the drafts back so each call depends on the one before.
    return state, jax.lax.dynamic_update_slice_in_dim(tokens, drafts, 1, axis=1)

  return jax.lax.fori_loop(0, num_calls, call, (state, tokens))[1]


def propose_seconds(drafter: Drafter, params, encoder_tokens, gamma: int, cache_length: int,
                    sampling: SamplingConfig, calls: tuple[int, int] = (8, 72),
                    repeats: int = 5) -> float:
  """Seconds of one drafter proposal of gamma tokens, as speculative decoding calls it."""
  batch = encoder_tokens.shape[0]
  tokens = jnp.ones((batch, cache_length - gamma), jnp.int32)
  run = lambda n: propose_calls(params, encoder_tokens, tokens, n, drafter=drafter,
                                 gamma=gamma, cache_length=cache_length, sampling=sampling)
  return _slope(run, *calls, repeats)


# ---------------------------------------------------------------------------
# Walltime of whole decodes, side by side.


def balanced_order(names: Sequence[str], k: int) -> list[str]:
  """The k-th order of `names` in a carryover-balanced cycle (a Williams design: the
  sequence 0, 1, n-1, 2, n-2, ... shifted by one each order, and for an odd number of
  names each shift also reversed, alternately): over a cycle (n orders, 2n for odd n)
  every decoder runs right after every other one equally often."""
  count = len(names)
  if count < 2:
    return list(names)
  sequence = [0]
  low, high = 1, count - 1
  while low <= high:
    sequence.append(low)
    if low != high:
      sequence.append(high)
    low, high = low + 1, high - 1
  shift, reverse = (k, False) if count % 2 == 0 else (k // 2, k % 2 == 1)
  order = [names[(index + shift) % count] for index in sequence]
  return order[::-1] if reverse else order


def time_side_by_side(decoders: Mapping[str, Callable[[int], Any]], num_items: int,
                      repeats: int, outputs: dict | None = None) -> dict[str, list[float]]:
  """{name: [total seconds of repetition r]} for decoders called as fn(item).

  Every decoder runs once on item 0 first (compilation). Then, per repetition and per
  item, the decoders run one after the other, so a change in machine load hits all
  of them alike, in an order that changes at every item (`balanced_order`): a decoder
  always run right after the same other one inherits the state that one leaves in the
  caches (measured on a 2-core CPU: a tiny baseline 18% slower right after a speculative
  decode than right after itself), and the comparison with it. outputs, if given,
  receives {name: [output of item i]} from the last repetition, so callers need not
  decode again to inspect what was timed.
  """
  for decode in decoders.values():
    jax.block_until_ready(decode(0))
  totals = {name: [0.0] * repeats for name in decoders}
  names = list(decoders)
  for r in range(repeats):
    for item in range(num_items):
      for name in balanced_order(names, r * num_items + item):
        decode = decoders[name]
        start = time.perf_counter()
        output = jax.block_until_ready(decode(item))
        totals[name][r] += time.perf_counter() - start
        if outputs is not None and r == repeats - 1:
          outputs.setdefault(name, []).append(output)
  return totals


# ---------------------------------------------------------------------------
# The T5X-style reference decoder.


def t5x_style_generate(params, encoder_tokens, rng=None, *, config: T5Config,
                       max_decode_length: int, sampling: SamplingConfig = SamplingConfig(),
                       eos_id: int = EOS_ID):
  """tokens [b, max_decode_length]: one token per step, cross K/V projected every step.

  T5X's decoder keeps the encoder output in the decode loop and its cross-attention
  projects keys and values from it at every step; this does the same through
  jaxspec's T5 and jaxspec's T5X-compatible `temperature_sample` (same params; given
  generate's per-row keys, the same samples as `baseline.generate`).
  """
  return _t5x_style_generate(params, encoder_tokens, rng, config=config,
                             max_decode_length=max_decode_length, sampling=sampling,
                             eos_id=eos_id)


@functools.partial(jax.jit, static_argnames=('config', 'max_decode_length', 'sampling',
                                             'eos_id'))
def _t5x_style_generate(params, encoder_tokens, rng, *, config, max_decode_length, sampling,
                        eos_id):
  model = T5(config)
  encoded = model.apply(params, encoder_tokens, method=T5.encode)  # [b, s, e]
  cache = model.apply(params, encoded, encoder_tokens, max_decode_length, method=T5.init_cache)

  def tokens_to_logits(state: baseline.DecodingState):
    decoder_cache, encoded = state.cache
    fresh = model.apply(params, encoded, encoder_tokens, 1, method=T5.init_cache)
    decoder_cache = decoder_cache.replace(layers=tuple(
        layer.replace(cross_keys=new.cross_keys, cross_values=new.cross_values)
        for layer, new in zip(decoder_cache.layers, fresh.layers)))
    logits, decoder_cache = model.apply(params, state.cur_token, decoder_cache,
                                        method=T5.decode)  # [b, 1, v]
    return logits[:, 0], (decoder_cache, encoded)

  batch = encoder_tokens.shape[0]
  decodes, _ = baseline.temperature_sample(
      jnp.zeros((batch, max_decode_length), jnp.int32), (cache, encoded), tokens_to_logits,
      eos_id, decode_rng=common.row_keys(rng, batch), temperature=sampling.temperature,
      topk=sampling.top_k, topp=sampling.top_p if sampling.top_p < 1.0 else 0.0)  # [b, 1, L]
  return decodes[:, 0]


# ---------------------------------------------------------------------------
# Verification options side by side: tokens per target call.


def verification_option_specs(gamma: int, confidence_threshold: float,
                              num_drafts: Sequence[int] = ()) -> dict:
  """{name: SpeculativeConfig}: plain (token-wise), block and coupled verification,
  adaptive gamma
  (gamma the maximum, rows stop below the threshold), both, and multi-draft
  verification with k branches for each k in num_drafts."""
  specs = {
      'plain': SpeculativeConfig(gamma),
      'block': SpeculativeConfig(gamma, verification='block'),
      'coupled': SpeculativeConfig(gamma, verification='coupled'),
      'adaptive': SpeculativeConfig(gamma, draft_confidence_threshold=confidence_threshold),
      'block + adaptive': SpeculativeConfig(gamma, verification='block',
                                            draft_confidence_threshold=confidence_threshold),
  }
  specs.update({f'multi-draft k={k}': SpeculativeConfig(gamma, num_drafts=k)
                for k in num_drafts})
  return specs


def option_row(name: str, spec: SpeculativeConfig, outputs: Sequence[Any]) -> dict:
  """One row of the side-by-side table from the SpeculativeOutputs of one option over
  the same inputs and keys: tokens per target call, alpha, mean drafts accepted and
  proposed per iteration."""
  tokens = sum(int(np.sum(np.asarray(o.output.lengths))) for o in outputs)
  calls = sum(int(np.sum(np.asarray(o.stats.row_target_calls))) for o in outputs)
  accepted = sum(np.asarray(o.stats.num_accepted_counts, np.int64) for o in outputs)
  drafted = sum(np.asarray(o.stats.num_drafted_counts, np.int64) for o in outputs)
  overlap = sum(float(o.stats.overlap_sum) for o in outputs)
  verified = sum(int(o.stats.verified_positions) for o in outputs)
  iterations = max(int(accepted.sum()), 1)
  counts = np.arange(len(accepted))
  return {'option': name, 'verification': spec.verification, 'gamma': spec.gamma,
          'draft_confidence_threshold': spec.draft_confidence_threshold,
          'num_drafts': spec.num_drafts,
          'tokens_per_target_call': tokens / max(calls, 1),
          'alpha': overlap / max(verified, 1),
          'accepted_per_iteration': float(accepted @ counts) / iterations,
          'drafted_per_iteration': float(drafted @ counts) / iterations,
          'tokens': tokens, 'target_calls': calls}


def walltime_fields(totals: Mapping[str, Sequence[float]], name: str) -> dict:
  """Median total seconds of decoder `name` (from time_side_by_side) and its speedup
  (a ratio of medians) over 'plain' and 'baseline' where those were timed."""
  seconds = float(np.median(totals[name]))
  row = {'seconds': seconds}
  for reference in ('plain', 'baseline'):
    if reference in totals:
      row[f'speedup_vs_{reference}'] = float(np.median(totals[reference])) / seconds
  return row


def compare_verification_options(decode: Callable[[SpeculativeConfig, int], Any],
                                 specs: Mapping[str, SpeculativeConfig], num_items: int,
                                 repeats: int = 1,
                                 baseline: Callable[[int], Any] | None = None) -> list[dict]:
  """decode(spec, i) -> the SpeculativeOutput of item i under spec (same inputs and keys
  for every spec); baseline(i), if given, the baseline's decode of item i. Every option
  (and the baseline) is timed by time_side_by_side, interleaved item by item, repeats
  times; -> per spec, in order, its option_row (from the last repetition's outputs)
  with its walltime_fields."""
  decoders = {} if baseline is None else {'baseline': baseline}
  decoders.update({name: functools.partial(decode, spec) for name, spec in specs.items()})
  outputs = {}
  totals = time_side_by_side(decoders, num_items, repeats, outputs)
  return [{**option_row(name, spec, outputs[name]), **walltime_fields(totals, name)}
          for name, spec in specs.items()]


# ---------------------------------------------------------------------------
# Beam search against speculative beam search.


def best_beam_tokens(beam_output, eos_id: int = EOS_ID) -> list[list[int]]:
  """Per row of a BeamOutput, the best beam's tokens (the last; T5X sorts ascending)
  through EOS."""
  return [inference.trim_at_eos(row[-1], eos_id) for row in np.asarray(beam_output.tokens)]


def beam_agreement(plain_beams, speculative_beams) -> tuple[int, int, float]:
  """plain_beams, speculative_beams: per example (every beam's tokens, every beam's
  score) -> (examples equal in every beam's tokens, equal in tokens and scores exactly,
  the largest score difference)."""
  same_tokens = [a[0] == b[0] for a, b in zip(plain_beams, speculative_beams)]
  same_scores = [a[1] == b[1] for a, b in zip(plain_beams, speculative_beams)]
  differences = [abs(x - y) for a, b in zip(plain_beams, speculative_beams)
                 for x, y in zip(a[1], b[1])]
  return (sum(same_tokens), sum(t and s for t, s in zip(same_tokens, same_scores)),
          max(differences, default=0.0))


def beam_comparison(plain_outputs: Sequence[Any], speculative_outputs: Sequence[Any],
                    eos_id: int = EOS_ID) -> dict:
  """From per-item BeamOutputs of beam search and SpeculativeBeamOutputs over the same
  inputs: target calls of each (a plain search calls the target once per step), both
  per output token of the best beams, search steps per speculative call, and how many
  examples (rows) agree in every beam's tokens through EOS, and in tokens and scores
  exactly (the largest score difference beside; beam_agreement)."""
  tokens = sum(len(t) for o in plain_outputs for t in best_beam_tokens(o, eos_id))
  plain_calls = sum(int(o.steps) for o in plain_outputs)
  speculative_calls = sum(int(o.stats.target_calls) for o in speculative_outputs)
  def beams(output, row):  # -> (every beam's tokens through EOS, every beam's score)
    return ([inference.trim_at_eos(t, eos_id) for t in np.asarray(output.tokens)[row]],
            np.asarray(output.scores)[row].tolist())
  same_tokens, same_both, difference = beam_agreement(
      [beams(o, row) for o in plain_outputs for row in range(len(o.scores))],
      [beams(o.output, row) for o in speculative_outputs for row in range(len(o.output.scores))])
  return {'tokens': tokens, 'beam_target_calls': plain_calls,
          'speculative_beam_target_calls': speculative_calls,
          'beam_target_calls_per_token': plain_calls / max(tokens, 1),
          'speculative_beam_target_calls_per_token': speculative_calls / max(tokens, 1),
          'search_steps_per_target_call': (sum(int(o.output.steps) for o in speculative_outputs)
                                           / max(speculative_calls, 1)),
          'identical_tokens': int(same_tokens), 'identical_tokens_and_scores': int(same_both),
          'max_score_difference': difference}
