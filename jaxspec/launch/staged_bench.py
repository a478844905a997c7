"""Staged against single-stage speculation on the main pair, side by side.

  jaxspec-staged-bench                                  # 100 EnDe test examples, batch 1
  jaxspec-staged-bench --num_examples=300 --gamma=9 --lookaheads=1,2,3 --temperatures=0,1

Decodes the first test examples of the 54M EnDe pair one at a time with the baseline,
the main job's int8 draft (single-stage) and the int8 draft staged on the shipped small
T5 draft (jaxspec.StagedDrafter) at each lookahead, interleaved example by example
(jaxspec.measure.benchmark.time_side_by_side, fastest of the repetitions), with coupled
verification as the main job. Each row: tokens per second, speedup over the baseline,
the staged decoder's gain over single-stage, identical outputs, alpha, and the stages'
rounds, drafter steps and acceptance, and the gain the parts' costs predict from those
counts (component_costs: the int8 draft's step over 1..k + 1 positions, the proposer's
proposal, the target's steps, timed apart first). Writes <output_dir>/<machine>.json and .md after
each temperature, with the commit, date, machine, load and command.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import inference, pairs
from jaxspec.config import EOS_ID
from jaxspec.data import corpora
from jaxspec.decoding.baseline import generate
from jaxspec.decoding import speculative
from jaxspec.decoding.drafters import DraftContext, Int8Drafter, StagedDrafter, T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.launch import bench_output, command
from jaxspec.measure.benchmark import time_side_by_side
from jaxspec.model import T5, rollback
from jaxspec.sampling import SamplingConfig

PAIR = 'ende54m_local'
INPUT_BUCKETS = (16, 24, 32, 48, 64)  # the main job's input_length_buckets, and its length
COLUMNS = ('temperature', 'gamma', 'decoder', 'tokens_per_second', 'speedup',
           'gain_over_single_stage', 'predicted_gain', 'identical_outputs', 'alpha', 'target_calls',
           'drafter_steps', 'rounds', 'stage_acceptance')


def bucketed(tokens: np.ndarray) -> np.ndarray:
  """One example's encoder tokens [1, L] cut to the shortest bucket that holds them."""
  used = int(np.max(np.nonzero(tokens[0])[0], initial=-1)) + 1
  length = next((b for b in INPUT_BUCKETS if b >= used), tokens.shape[1])
  return tokens[:, :length]


def decoders(pair, int8_params, *, gamma: int, lookaheads, sampling: SamplingConfig):
  """{name: decode(tokens [1, s], key) -> (output tokens [1, L], SpeculativeOutput or None)}
  for the pair (its draft the proposer) and the int8 draft's params."""
  int8 = Int8Drafter(pair.target_config)
  spec = SpeculativeConfig(gamma=gamma, verification='coupled')
  common = dict(target_config=pair.target_config, max_decode_length=pair.max_decode_length,
                sampling=sampling)

  def baseline(tokens, key):
    return generate(pair.target_params, tokens, key, config=pair.target_config,
                    max_decode_length=pair.max_decode_length, sampling=sampling).tokens, None

  def speculative(drafter, params):
    def decode(tokens, key):
      result = speculative_generate(pair.target_params, params, tokens, key, drafter=drafter,
                                    spec=spec, **common)
      return result.output.tokens, result
    return decode

  named = {'baseline': baseline, 'single-stage': speculative(int8, int8_params)}
  for k in lookaheads:
    staged = StagedDrafter(drafter=int8, proposer=T5Drafter(pair.draft_config), lookahead=k)
    named[f'staged k={k}'] = speculative(staged, {'drafter': int8_params,
                                                  'proposer': pair.draft_params})
  return named


def rows_for(outputs, seconds, gamma: int, temperature: float) -> list[dict]:
  """Table rows from each decoder's outputs over the examples and its fastest seconds."""
  reference = [np.asarray(t) for t, _ in outputs['baseline']]
  tokens = sum(len(inference.trim_at_eos(t[0], EOS_ID)) for t in reference)
  rows = []
  for name, results in outputs.items():
    identical = sum(np.array_equal(np.asarray(t), r) for (t, _), r in zip(results, reference))
    row = {'temperature': temperature, 'gamma': gamma if name != 'baseline' else None,
           'decoder': name, 'tokens_per_second': tokens / seconds[name],
           'speedup': seconds['baseline'] / seconds[name],
           'identical_outputs': f'{identical}/{len(reference)}'}
    stats = [s for _, s in results if s is not None]
    if stats:
      verified = sum(int(s.stats.verified_positions) for s in stats)
      row['alpha'] = sum(float(s.stats.overlap_sum) for s in stats) / max(verified, 1)
      row['target_calls'] = sum(int(s.stats.target_calls) for s in stats)
      stages = [s.drafter_stats.summary() for s in stats if s.drafter_stats is not None]
      drafts = sum(int(np.sum(np.arange(len(s.stats.num_drafted_counts))
                              * np.asarray(s.stats.num_drafted_counts))) for s in stats)
      if stages:
        first = [sum(stage[0][key] for stage in stages)
                 for key in ('drafter_steps', 'rounds', 'proposed', 'accepted')]
        row.update(drafter_steps=first[0], rounds=first[1],
                   stage_acceptance=first[3] / max(first[2], 1))
      else:  # single stage: one drafter step per draft
        row['drafter_steps'] = drafts
    rows.append(row)
  single = next(r for r in rows if r['decoder'] == 'single-stage')
  for row in rows:
    if row['decoder'].startswith('staged'):
      row['gain_over_single_stage'] = row['tokens_per_second'] / single['tokens_per_second']
  return rows


STEP_CALLS = (16, 96)  # decode steps (proposals) per timed call; their difference times one


def _slopes_ms(runs: dict, repeats: int) -> dict:
  """{name: milliseconds of one unit of runs[name](n)} (a jitted loop of n): every run at
  each count of STEP_CALLS, interleaved over `repeats` rounds so a change of load hits
  them alike, the fastest of each; fixed costs cancel in the difference."""
  for run in runs.values():
    for count in STEP_CALLS:
      jax.block_until_ready(run(count))
  best = {(name, count): float('inf') for name in runs for count in STEP_CALLS}
  for _ in range(repeats):
    for name, run in runs.items():
      for count in STEP_CALLS:
        start = time.perf_counter()
        jax.block_until_ready(run(count))
        best[name, count] = min(best[name, count], time.perf_counter() - start)
  short, long = STEP_CALLS
  return {name: 1e3 * (best[name, long] - best[name, short]) / (long - short)
          for name in runs}


def component_costs(pair, int8, int8_params, proposer, proposer_params, *, gamma: int,
                    lookaheads, repeats: int = 5) -> dict:
  """Milliseconds of the parts of an iteration on the first test example's encoding:
  the int8 draft's decode step over 1..max(lookaheads) + 1 positions, the proposer's
  proposal of k tokens for each lookahead, and the target's steps over 1 and gamma + 1
  positions (greedy; each step's input depends on the one before)."""
  tokens = bucketed(pair.encode([corpora.load_split(pair.task, 'test')[0]['inputs']]))
  tokens = jnp.asarray(tokens)
  room = pair.max_decode_length + gamma + max(lookaheads)
  target_cache, encoded = speculative._encode(  # pylint: disable=protected-access
      pair.target_params, tokens, target_config=pair.target_config, cache_length=room)
  int8_state = int8.init_state_for_decode(int8_params, tokens, encoded, room, target_cache)
  proposer_state = proposer.init_state_for_decode(proposer_params, tokens, encoded, room,
                                                  target_cache)
  target_decode = lambda t, c: T5(pair.target_config).apply(  # noqa: E731
      pair.target_params, t, c, method=T5.decode)

  def steps(decode, cache, positions):
    @jax.jit
    def run(count):
      def body(i, carry):
        cache, token = carry
        inputs = jnp.full((1, positions), token, jnp.int32)
        logits, cache = decode(inputs, rollback(cache, jnp.full((1,), 8 + i % 4, jnp.int32)))
        return cache, 3 + jnp.argmax(logits[0, -1]).astype(jnp.int32) % 5
      return jax.lax.fori_loop(0, count, body, (cache, jnp.int32(3)))[1]
    return run

  def proposals(k):
    prefix = jnp.full((1, pair.max_decode_length), 3, jnp.int32)

    @jax.jit
    def run(count):
      def body(i, carry):
        state, prefix = carry
        context = DraftContext(tokens=prefix, length=jnp.full((1,), 8 + i % 4, jnp.int32),
                               encoder_tokens=tokens)
        drafts, _, state = proposer.propose(proposer_params, state, context, k,
                                            SamplingConfig(), jax.random.split(
                                                jax.random.PRNGKey(0), 1))
        return state, jax.lax.dynamic_update_slice_in_dim(prefix, drafts, 8, axis=1)
      return jax.lax.fori_loop(0, count, body, (proposer_state, prefix))[1]
    return run

  int8_decode = int8.decoder(int8_params)
  runs = {('int8_step_ms', t): steps(int8_decode, int8_state, t)
          for t in range(1, max(lookaheads) + 2)}
  runs.update({('proposer_ms', k): proposals(k) for k in lookaheads})
  runs.update({('target_step_ms', t): steps(target_decode, target_cache, t)
               for t in (1, gamma + 1)})
  costs = {}
  for (part, size), ms in _slopes_ms(runs, repeats).items():
    costs.setdefault(part, {})[size] = ms
  return costs


def predicted_gain(costs: dict, single: dict, staged: dict, k: int, gamma: int) -> float:
  """The staged decoder's tokens per second over single-stage's predicted from the
  component costs and each run's counts (target calls, drafter steps, rounds): each
  iteration a verify step of gamma + 1 positions, the drafter's first step (two
  positions), then single-stage one-position steps, staged a proposal and a k + 1
  position step per round."""
  verify = costs['target_step_ms'][gamma + 1]
  first = costs['int8_step_ms'][2]

  def total(row, per_step):
    calls = row['target_calls']
    return calls * (verify + first) + (row['drafter_steps'] - calls) * per_step

  single_ms = total(single, costs['int8_step_ms'][1])
  staged_ms = total(staged, costs['int8_step_ms'][k + 1] + costs['proposer_ms'][k])
  return single_ms / staged_ms


def run(*, num_examples: int, gamma: int, lookaheads, temperatures, repeats: int,
        output_dir: str, name: str, argv=()) -> dict:
  pair = pairs.load(PAIR, draft='small')
  examples = corpora.load_split(pair.task, 'test')[:num_examples]
  inputs = [bucketed(pair.encode([e['inputs']])) for e in examples]
  record = {'pair': PAIR, 'num_examples': len(inputs), 'repeats': repeats,
            'provenance': bench_output.provenance('jaxspec-staged-bench', argv), 'rows': []}
  int8 = Int8Drafter(pair.target_config)
  int8_params = int8.draft_params(pair.target_params)  # quantized once for every decoder
  record['costs'] = component_costs(pair, int8, int8_params,
                                    T5Drafter(pair.draft_config), pair.draft_params,
                                    gamma=gamma, lookaheads=lookaheads)
  jax.clear_caches()
  print(f"costs (ms): {record['costs']}", file=sys.stderr, flush=True)
  for temperature in temperatures:
    sampling = SamplingConfig(temperature=float(temperature))
    named = decoders(pair, int8_params, gamma=gamma, lookaheads=lookaheads,
                     sampling=sampling)
    keys = [jax.random.PRNGKey(i) for i in range(len(inputs))]
    for length in sorted({x.shape[1] for x in inputs}):  # compile every bucket first
      example = next(x for x in inputs if x.shape[1] == length)
      for decode in named.values():
        jax.block_until_ready(decode(jnp.asarray(example), keys[0]))
    outputs = {}
    totals = time_side_by_side(
        {n: (lambda i, d=d: d(jnp.asarray(inputs[i]), keys[i])) for n, d in named.items()},
        len(inputs), repeats, outputs)
    seconds = {n: min(t) for n, t in totals.items()}
    rows = rows_for(outputs, seconds, gamma, float(temperature))
    if 'costs' in record:
      single = next(r for r in rows if r['decoder'] == 'single-stage')
      for row, k in zip((r for r in rows if r['decoder'].startswith('staged')), lookaheads):
        row['predicted_gain'] = predicted_gain(record['costs'], single, row, k, gamma)
    record['rows'] += rows
    jax.clear_caches()
    bench_output.write_table(output_dir, name, record, COLUMNS,
                            f"Staged against single-stage speculation ({PAIR}, int8 draft "
                            f"staged on draft_small, batch 1, gamma {gamma}, coupled "
                            f"verification)")
    for row in record['rows'][-len(named):]:
      print(f"T={temperature:g} {row['decoder']}: speedup {row['speedup']:.2f}",
            file=sys.stderr, flush=True)
  return record


def main(argv: list[str] | None = None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--num_examples', type=int, default=100)
  parser.add_argument('--gamma', type=int, default=9,
                      help='gamma of both speculative decoders')
  parser.add_argument('--lookaheads', type=bench_output.int_list, default=[1, 2, 3])
  parser.add_argument('--repeats', type=int, default=2)
  bench_output.add_run_flags(parser, 'results/staged')
  command.add_verbose_flag(parser)
  args = parser.parse_args(argv)
  name = args.name or bench_output.machine_name()
  run(num_examples=args.num_examples, gamma=args.gamma, lookaheads=args.lookaheads,
      temperatures=args.temperatures, repeats=args.repeats, output_dir=args.output_dir,
      name=name, argv=argv)


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())
