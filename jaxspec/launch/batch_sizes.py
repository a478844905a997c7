"""The main job at every batch size: baseline and speculative decoding side by side.

  jaxspec-batch-sizes                                   # the main job, batch 1..32, T = 0 and 1
  jaxspec-batch-sizes --batch_sizes=1,8 --temperatures=0 --num_examples=64

For each batch size and temperature it runs the launcher (jaxspec.launch.infer) on the
main job's gin file with that batch size and temperature, baseline and speculative
interleaved batch by batch in one process, and collects tokens per second of each,
their ratio, the gammas gamma='auto' chose and identical outputs. After each run it
rewrites <output_dir>/<machine>.json and .md (so a cut-off run keeps what it measured),
and at the end a PNG of speedup against batch size. Each record carries the commit,
date, machine (CPU model, cores, caches; or the accelerator), load and command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import gin
import jax

from jaxspec.launch import bench_output, command, gin_flags, platform_settings
from jaxspec.launch import infer as infer_script

DEFAULT_GIN_FILE = infer_script.DEFAULT_GIN_FILE
COLUMNS = ('batch_size', 'temperature', 'examples', 'baseline_tokens_per_second',
           'speculative_tokens_per_second', 'speedup', 'gamma_choices', 'alpha',
           'identical_outputs')


def row(summary: dict, batch_size: int, temperature: float) -> dict:
  """One table row from the launcher's summary (its records' tokens over its seconds)."""
  tokens = summary['output_tokens']
  return {
      'batch_size': batch_size, 'temperature': temperature, 'examples': summary['examples'],
      'baseline_tokens_per_second': tokens / summary['baseline_seconds'],
      'speculative_tokens_per_second': tokens / summary['speculative_seconds'],
      'speedup': summary['speedup'], 'gamma_choices': summary.get('gamma_choices', ''),
      'alpha': summary.get('alpha'),
      'identical_outputs': f"{summary['identical_outputs']}/{summary['examples']}"}


def write(output_dir: str, name: str, record: dict, plot: bool = False):
  bench_output.write_table(output_dir, name, record, COLUMNS,
              f"Main job at each batch size ({record['gin_file']})")
  if plot and record['rows']:
    _plot(os.path.join(output_dir, name) + '.png', record['rows'])


def _plot(path: str, rows):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  figure, axis = plt.subplots(figsize=(6, 4))
  for temperature in sorted({r['temperature'] for r in rows}):
    points = sorted((r['batch_size'], r['speedup']) for r in rows
                    if r['temperature'] == temperature)
    axis.plot(*zip(*points), marker='o', label=f'T = {temperature:g}')
  axis.axhline(1.0, color='gray', linewidth=0.8)
  axis.set_xscale('log', base=2)
  axis.set_xlabel('batch size')
  axis.set_ylabel('speedup over the baseline')
  axis.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)


def run(*, gin_file: str, batch_sizes, temperatures, num_examples: int, output_dir: str,
        name: str, extra_flags=(), argv=()) -> dict:
  record = {'gin_file': gin_file, 'num_examples': num_examples,
            'provenance': bench_output.provenance('jaxspec-batch-sizes', argv), 'rows': []}
  for temperature in temperatures:
    for batch_size in batch_sizes:
      gin.clear_config()
      run_dir = os.path.join(output_dir, 'runs', f'{name}_b{batch_size}_t{temperature:g}')
      # Measured anew: the launcher would resume an earlier invocation's records (timed by
      # another process, perhaps other code) and report their seconds.
      shutil.rmtree(run_dir, ignore_errors=True)
      gin_flags.parse([f'--gin_file={gin_file}', *extra_flags,
                       f'--gin.TEMPERATURE={float(temperature)}',
                       f'--gin.infer.batch_size={batch_size}',
                       f'--gin.infer.num_examples={num_examples}',
                       f"--gin.infer.output_dir='{run_dir}'"])
      summary = infer_script.infer()
      # Each run compiles its own programs; a process holding every run's would run out
      # of memory mappings (XLA:CPU maps each compiled program).
      jax.clear_caches()
      record['rows'].append(row(summary, batch_size, float(temperature)))
      record['platform_settings'] = summary['platform_settings']
      record['provenance']['load_average'] = f'{os.getloadavg()[0]:.2f}'  # 1 minute
      write(output_dir, name, record)
      print(f'batch {batch_size}, T={temperature:g}: speedup {summary["speedup"]:.2f} '
            f'({summary.get("gamma_choices", "")})', file=sys.stderr, flush=True)
  write(output_dir, name, record, plot=True)
  return record


def main(argv: list[str] | None = None):
  platform_settings.apply()  # before JAX starts its backend, which reads XLA_FLAGS once
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--gin_file', default=DEFAULT_GIN_FILE)
  parser.add_argument('--batch_sizes', type=bench_output.int_list,
                      default=[1, 2, 4, 8, 16, 32])
  parser.add_argument('--num_examples', type=int, default=256)
  bench_output.add_run_flags(parser, 'results/batch_sizes')
  command.add_verbose_flag(parser)
  args, extra = parser.parse_known_args(argv)
  if any(not flag.startswith('--gin') for flag in extra):
    parser.error(f'unknown flags {extra}')
  name = args.name or bench_output.machine_name()
  run(gin_file=args.gin_file, batch_sizes=args.batch_sizes, temperatures=args.temperatures,
      num_examples=args.num_examples, output_dir=args.output_dir, name=name,
      extra_flags=extra, argv=argv)


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())
