"""Soak test: thousands of examples in one process, watching memory and compilations.

  python scripts/soak.py                                   # configs/soak/ende_local.gin
  python scripts/soak.py --gin_file=configs/soak/tiny.gin  # tiny random models, fast
  python scripts/soak.py --gin.soak.num_examples=500 --gin.soak.batch_sizes='(1, 8)'

Each batch is decoded by the baseline and by speculative decoding, in turn, over a
shipped split cycled to `num_examples`, with batch sizes cycling through the buckets
`batch_sizes` (one compiled program per decoder and bucket). Every `report_every`
batches it prints the resident memory (RSS) and the XLA compilations so far. The first
`warmup_batches` batches compile every program; the run fails (exit status 1) if a
compilation happens after them, or if the RSS rises more than `max_rss_growth_mb`
above its value at the end of the warm-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys


import gin
import jax
import numpy as np

from jaxspec.launch import command, gin_flags
from jaxspec.launch import infer as infer_script
from jaxspec import errors, inference
from jaxspec.config import T5Config
from jaxspec.data import corpora
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import init_params
from jaxspec.sampling import SamplingConfig

DEFAULT_GIN_FILE = 'configs/soak/ende_local.gin'
BACKEND_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


def rss_mb() -> float:
  """The resident memory of this process now (/proc), else its peak (getrusage)."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
  except OSError:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == 'darwin' else peak / 2**10


class CompileCount:
  """Counts XLA backend compilations while active (a jax.monitoring listener)."""

  def __init__(self):
    self.count = 0

  def __call__(self, event: str, duration: float, **kwargs):
    del duration, kwargs
    if event == BACKEND_COMPILE_EVENT:
      self.count += 1


@contextlib.contextmanager
def counting_compiles():
  counter = CompileCount()
  jax.monitoring.register_event_duration_secs_listener(counter)
  try:
    yield counter
  finally:
    jax.monitoring.unregister_event_duration_listener(counter)


def batch_plan(num_examples: int, batch_sizes: tuple[int, ...]) -> list[tuple[int, list[int]]]:
  """(bucket, consecutive example numbers) per batch; the buckets cycle and the last
  batch may hold fewer examples than its bucket."""
  plan, start = [], 0
  while start < num_examples:
    bucket = batch_sizes[len(plan) % len(batch_sizes)]
    plan.append((bucket, list(range(start, min(start + bucket, num_examples)))))
    start += bucket
  return plan


def failures(rss_growth_mb: float, compiles_after_warmup: int,
             max_rss_growth_mb: float) -> list[str]:
  """Why the soak failed, empty if it passed."""
  found = []
  if compiles_after_warmup:
    found.append(f'{compiles_after_warmup} compilations after the warm-up (a shape or '
                 'static argument outside the buckets)')
  if rss_growth_mb > max_rss_growth_mb:
    found.append(f'RSS grew by {rss_growth_mb:.1f} MB after the warm-up, more than '
                 f'{max_rss_growth_mb:.1f} MB')
  return found


def _params(config: T5Config, checkpoint: str | None, seed: int):
  """A checkpoint's params, or random ones (tiny soak runs) when there is none."""
  if checkpoint:
    return inference.load_model_params(checkpoint, config)
  return init_params(config, jax.random.PRNGKey(seed))


@gin.configurable
def soak(*, target_model: T5Config = gin.REQUIRED, drafter=gin.REQUIRED,
         target_checkpoint: str | None = None, draft_checkpoint: str | None = None,
         corpus: str = 'ende', split: str = 'test', num_examples: int = 3000,
         batch_sizes: tuple[int, ...] = (1, 2, 4, 8), input_length: int = 64,
         max_decode_length: int = 64, sampling: SamplingConfig = SamplingConfig(),
         speculative: SpeculativeConfig = SpeculativeConfig(), report_every: int = 25,
         warmup_batches: int | None = None, max_rss_growth_mb: float = 64.0,
         seed: int = 0) -> dict:
  """Runs the soak and returns its report; report['failures'] is empty if it passed.

  Checkpoints left None use random params (seeded), for tiny models. warmup_batches
  defaults to two rounds of the buckets.
  """
  warmup_batches = 2 * len(batch_sizes) if warmup_batches is None else warmup_batches
  batches = batch_plan(num_examples, batch_sizes)
  if len(batches) <= warmup_batches:
    raise errors.InvalidSetting(f'{len(batches)} batches do not outlast the {warmup_batches} '
                                'warm-up batches; raise soak.num_examples')
  vocab = corpora.Vocabulary()
  examples = corpora.load_split(corpus, split)
  inputs, truncated = inference.fit_inputs(
      [corpora.input_ids(e, corpus, vocab) for e in examples], input_length, 'truncate')
  target_params = _params(target_model, target_checkpoint, seed)
  if isinstance(drafter, T5Drafter):
    draft_params = _params(drafter.config, draft_checkpoint, seed + 1)
  else:
    draft_params = infer_script.drafter_params(drafter, draft_checkpoint, corpus, vocab,
                                               max_decode_length)
  rng = jax.random.PRNGKey(seed)

  def decode_batch(bucket, indices):
    rows = np.asarray(indices + [indices[-1]] * (bucket - len(indices)))  # padded
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, rows)
    batch = inputs[rows % len(examples)]  # The split is cycled.
    baseline = generate(target_params, batch, keys, config=target_model,
                        max_decode_length=max_decode_length, sampling=sampling)
    result = speculative_generate(
        target_params, draft_params, batch, keys, target_config=target_model,
        drafter=drafter, spec=speculative, max_decode_length=max_decode_length,
        sampling=sampling)
    # Fetched to the host, as the launcher does.
    return np.asarray(baseline.tokens), np.asarray(result.output.tokens)

  report = {'examples': num_examples, 'batches': len(batches), 'batch_sizes': batch_sizes,
            'truncated_inputs': len(truncated), 'warmup_batches': warmup_batches}
  report.update(_watch(decode_batch, batches, warmup_batches, report_every))
  report['failures'] = failures(report['rss_growth_mb'], report['compiles_after_warmup'],
                                max_rss_growth_mb)
  return report


def _watch(decode_batch, batches, warmup_batches: int, report_every: int) -> dict:
  """Decodes the batches, printing RSS and compilations; what happened after warm-up."""
  rss_after_warmup, peak_after_warmup = 0.0, 0.0
  with counting_compiles() as compiles:
    for number, (bucket, indices) in enumerate(batches, 1):
      decode_batch(bucket, indices)
      if number == warmup_batches:
        rss_after_warmup, compiles_at_warmup = rss_mb(), compiles.count
      elif number > warmup_batches:
        peak_after_warmup = max(peak_after_warmup, rss_mb())
      if number % report_every == 0 or number == len(batches):
        print(f'batch {number}/{len(batches)}  examples {indices[-1] + 1}  '
              f'rss {rss_mb():.1f} MB  compiles {compiles.count}', flush=True)
  return {'rss_mb_after_warmup': rss_after_warmup,
          'rss_growth_mb': max(peak_after_warmup - rss_after_warmup, 0.0),
          'compiles_in_warmup': compiles_at_warmup,
          'compiles_after_warmup': compiles.count - compiles_at_warmup}


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not any(a.startswith('--gin_file') for a in argv):
    argv = [f'--gin_file={DEFAULT_GIN_FILE}'] + list(argv)
  gin_flags.parse(argv, description=__doc__.split('\n\n')[0], config_dirs=('soak',))
  report = soak()
  print(json.dumps(report, indent=2))
  for failure in report['failures']:
    print(f'FAILED: {failure}', file=sys.stderr)
  return 1 if report['failures'] else 0


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())
