"""Baseline vs speculative decoding, side by side in one process.

Decodes the same batch with `baseline.generate` and `speculative_generate`, checks
that greedy outputs are identical, and prints alpha, tokens per target call and the
walltime ratio (median of repeated runs after a compile warm-up). Models are named
configs with random weights unless checkpoints are given.

  python scripts/compare_decoders.py --target t5_1_1_small --draft tiny --gamma 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import get_config
from jaxspec.config import EOS_ID, T5Config
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import init_params
from jaxspec.sampling import SamplingConfig


def _parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--target', default='t5_1_1_small', help='named target config')
  parser.add_argument('--draft', default='self', help="named draft config, or 'self'")
  parser.add_argument('--vocab_size', type=int, default=512,
                      help='vocabulary of randomly initialized models')
  parser.add_argument('--gamma', type=int, default=4)
  parser.add_argument('--temperature', type=float, default=0.0)
  parser.add_argument('--batch_size', type=int, default=1)
  parser.add_argument('--input_length', type=int, default=32)
  parser.add_argument('--max_decode_length', type=int, default=32)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--seed', type=int, default=0)
  return parser.parse_args()


def _timed(fn, repeats: int):
  """Median walltime of fn() after one compile warm-up; returns (result, seconds)."""
  result = jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return result, statistics.median(times)


def _random_inputs(rng: np.random.RandomState, batch: int, length: int, vocab: int):
  lengths = rng.randint(length // 2, length + 1, size=batch)
  tokens = rng.randint(3, vocab, size=(batch, length)).astype(np.int32)
  for row, row_length in enumerate(lengths):
    tokens[row, row_length - 1] = EOS_ID
    tokens[row, row_length:] = 0
  return jnp.asarray(tokens)


def main():
  args = _parse_args()
  target_config: T5Config = get_config(args.target, vocab_size=args.vocab_size)
  draft_config = target_config if args.draft == 'self' else get_config(
      args.draft, vocab_size=args.vocab_size)
  target_params = init_params(target_config, jax.random.PRNGKey(args.seed))
  draft_params = target_params if args.draft == 'self' else init_params(
      draft_config, jax.random.PRNGKey(args.seed + 1))
  encoder_tokens = _random_inputs(np.random.RandomState(args.seed), args.batch_size,
                                  args.input_length, args.vocab_size)
  sampling = SamplingConfig(temperature=args.temperature)
  rng = jax.random.PRNGKey(args.seed)

  baseline, baseline_seconds = _timed(lambda: generate(
      target_params, encoder_tokens, rng, config=target_config,
      max_decode_length=args.max_decode_length, sampling=sampling), args.repeats)
  speculative, speculative_seconds = _timed(lambda: speculative_generate(
      target_params, draft_params, encoder_tokens, rng, target_config=target_config,
      drafter=T5Drafter(draft_config), spec=SpeculativeConfig(gamma=args.gamma),
      max_decode_length=args.max_decode_length, sampling=sampling), args.repeats)

  stats = speculative.stats
  identical = bool(jnp.all(baseline.tokens == speculative.output.tokens))
  print(f'target {args.target}, draft {args.draft}, temperature {args.temperature}, '
        f'gamma {args.gamma}, batch {args.batch_size}, device {jax.devices()[0].platform}')
  print(f'alpha                  {float(stats.alpha):.3f}')
  print(f'tokens per target call {float(stats.tokens_per_target_call(speculative.output.lengths)):.2f}')
  print(f'target calls           {int(stats.target_calls)} (baseline: '
        f'{int(jnp.max(baseline.lengths))})')
  print(f'walltime ratio         {baseline_seconds / speculative_seconds:.2f}x '
        f'(baseline / speculative, median of {args.repeats})')
  if sampling.is_greedy:
    print(f'greedy outputs identical: {identical}')
    if not identical:
      raise SystemExit('greedy speculative output differs from the baseline')


if __name__ == '__main__':
  main()
