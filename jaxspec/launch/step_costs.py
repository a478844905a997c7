"""Step-cost harness: V(k) of target decode steps per matmul variant, draft proposal costs.

  python scripts/step_costs.py                     # shipped target, 45M, 150M; all variants
  python scripts/step_costs.py --targets=local_target,t5_1_1_base --positions=1,2,4,8

For every target (a jaxspec config name; random weights, since values do not change
a step's cost) and variant of the decode matmuls ('t5x': kernel [in, out] through XLA;
'transposed': kernel_t [out, in] through XLA; 'kernel': kernel_t through jaxspec's
few-row CPU kernel, jaxspec.model.cpu.matmul; 'tiled': kernel_tiles [out / 16, in, 16]
through the kernel, where its AVX-512 build runs), the time of one cached decode step over
k = 1..9 positions, all (variant, k) timed in turn within each repetition; V(k) is the
median over repetitions of step(k) / step(1). Also XLA's FLOPs and bytes of each compiled step and the fraction of
this machine's measured memory bandwidth and matmul throughput the step reaches, and
each draft's proposal of gamma tokens (in each variant) against the target's one-position
step: c of Theorem 3.8; and each target's int8 draft (jaxspec.Int8Drafter, the target's
own decoder in int8) at --int8_gamma, against the target's step in the CPU's decode
layout ('tiled' where it runs, else 'kernel'; 0 skips it). Writes
<out>/step_costs.json, step_costs.md and v_of_k.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys


import jax
import jax.numpy as jnp

from jaxspec import machine
from jaxspec.measure import benchmark, step_costs
from jaxspec.config import get_config
from jaxspec.decoding.drafters.t5 import T5Drafter
from jaxspec.model import init_params
from jaxspec.sampling import SamplingConfig
from jaxspec.launch import command

def _parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--targets', default='local_target,local_target_45m,local_target_150m')
  parser.add_argument('--drafts', default='local_draft_small,local_draft_base')
  parser.add_argument('--positions', default='1,2,3,4,5,6,7,8,9')
  parser.add_argument('--gamma', type=int, default=3, help='draft tokens per proposal')
  parser.add_argument('--int8_gamma', type=int, default=8,
                      help="tokens per proposal of each target's int8 draft (0: not measured)")
  parser.add_argument('--feature_layers', type=int, default=0,
                      help="also each target's feature-level head of this many layers, in int8, "
                      'beside its int8 draft (0: not measured)')
  parser.add_argument('--repeats', type=int, default=15)
  parser.add_argument('--steps_per_call', type=int, default=10)
  defaults = step_costs.StepCostSetup()
  parser.add_argument('--source_length', type=int, default=defaults.source_length)
  parser.add_argument('--cache_position', type=int, default=defaults.cache_position,
                      help='decoder positions already in the cache when a step runs')
  parser.add_argument('--cache_length', type=int, default=defaults.cache_length)
  parser.add_argument('--out', default='results/step_costs')
  command.add_verbose_flag(parser)
  return parser.parse_args(argv)


def _names(text: str) -> list[str]:
  return [name for name in text.split(',') if name]


def proposal_seconds(draft_name: str, variant: str, gamma: int,
                     setup: step_costs.StepCostSetup) -> float:
  """Seconds of one gamma-token proposal of a random draft of that config, greedy."""
  config = get_config(draft_name)
  params, config = step_costs.variant(
      {'params': init_params(config, jax.random.PRNGKey(1))['params']}, config, variant)
  encoder_tokens = jnp.ones((setup.batch_size, setup.source_length), jnp.int32)
  return benchmark.propose_seconds(T5Drafter(config), params, encoder_tokens, gamma,
                                   setup.cache_length, SamplingConfig(temperature=0.0),
                                   repeats=setup.repeats // 3 + 1)


def _parameter_count(name: str) -> int:
  from jaxspec.model import abstract_params
  return sum(leaf.size for leaf in jax.tree.leaves(abstract_params(get_config(name))['params']))


def measure(args) -> dict:
  setup = step_costs.StepCostSetup(
      repeats=args.repeats, steps_per_call=args.steps_per_call,
      source_length=args.source_length, cache_position=args.cache_position,
      cache_length=args.cache_length)
  positions = [int(k) for k in _names(args.positions)]
  roofline = step_costs.machine_roofline()
  variants = step_costs.variants_here()
  targets = {}
  for name in _names(args.targets):
    costs = step_costs.measure_step_costs(get_config(name), positions, variants, setup)
    rows = {}
    for variant in variants:
      rows[variant] = {}
      for k, seconds in costs.step_seconds[variant].items():
        flops, bytes_ = costs.cost[variant][k]['flops'], costs.cost[variant][k]['bytes']
        rows[variant][k] = {
            'step_ms': 1e3 * seconds, 'V': costs.ratio[variant][k], 'flops': flops,
            'bytes': bytes_,
            'memory_roofline_fraction': bytes_ / seconds / roofline['bytes_per_second'],
            'compute_roofline_fraction': flops / seconds / roofline['flops_per_second']}
    targets[name] = {'parameters': _parameter_count(name), 'variants': rows}
    print(name, {variant: {k: round(r['V'], 2) for k, r in rows[variant].items()}
                 for variant in variants}, flush=True)
    if args.int8_gamma > 0:
      int8 = step_costs.measure_int8_draft_cost(get_config(name), args.int8_gamma, setup,
                                                feature_layers=args.feature_layers)
      targets[name]['int8_draft'] = {
          'gamma': int8.gamma, 'step_ms': 1e3 * int8.step_seconds,
          'verify_ms': 1e3 * int8.verify_seconds, 'proposal_ms': 1e3 * int8.proposal_seconds,
          'iteration_ms': 1e3 * int8.iteration_seconds,
          'interference_ms': 1e3 * int8.interference_seconds, 'c': int8.c,
          'target_variant': int8.target_variant}
      if int8.feature_layers:
        targets[name]['feature_head'] = {
            'layers': int8.feature_layers, 'gamma': int8.gamma, 'weights': 'int8',
            'proposal_ms': 1e3 * int8.feature_proposal_seconds, 'c': int8.feature_c}
      print(name, 'int8 draft', targets[name]['int8_draft'], flush=True)
  drafts = {}
  for name in _names(args.drafts):
    drafts[name] = {'parameters': _parameter_count(name),
                    'proposal_ms': {variant: 1e3 * proposal_seconds(name, variant, args.gamma,
                                                                    setup)
                                    for variant in variants}}
  return {
      'date': datetime.date.today().isoformat(), 'cpu': machine.cpu_model(),
      'backend': jax.default_backend(), 'devices': len(jax.devices()),
      'setup': vars(setup) if hasattr(setup, '__dict__') else str(setup),
      'gamma': args.gamma, 'roofline': roofline, 'variants': list(variants),
      'targets': targets, 'drafts': drafts}


def markdown(results: dict) -> str:
  gamma, variants = results['gamma'], results['variants']
  lines = [f"Step costs on {results['cpu']} ({results['backend']}, {results['devices']} "
           f"device(s)), {results['date']}. V(k) = step over k positions / step over 1 "
           'position, median over interleaved repetitions; roofline fractions of the '
           f"one-position step against {results['roofline']['bytes_per_second'] / 1e9:.1f} GB/s "
           f"and {results['roofline']['flops_per_second'] / 1e9:.0f} GFLOP/s measured here.", '']
  positions = sorted(next(iter(results['targets'].values()))['variants'][variants[0]])
  lines.append('| target | params | variant | 1-position step | vs t5x | memory roofline | '
               + ' | '.join(f'V({k})' for k in positions if k > 1) + ' |')
  lines.append('|---' * (6 + len(positions) - 1) + '|')
  for name, target in results['targets'].items():
    reference = target['variants'][variants[0]][positions[0]]['step_ms']
    for variant in variants:
      rows = target['variants'][variant]
      one = rows[positions[0]]
      lines.append(f"| {name} | {target['parameters'] / 1e6:.1f}M | {variant} | "
                   f"{one['step_ms']:.2f} ms | {one['step_ms'] / reference:.2f} | "
                   f"{one['memory_roofline_fraction']:.0%} | "
                   + ' | '.join(f"{rows[k]['V']:.2f}" for k in positions if k > 1) + ' |')
  lines += ['', f'Draft proposals of gamma = {gamma} tokens, as c = proposal / (gamma x the '
            "target's one-position step in the same variant):", '',
            '| draft | params | variant | proposal | '
            + ' | '.join(f'c vs {name}' for name in results['targets']) + ' |',
            '|---' * (4 + len(results['targets'])) + '|']
  for name, draft in results['drafts'].items():
    for variant in variants:
      proposal = draft['proposal_ms'][variant]
      cs = [proposal / gamma / target['variants'][variant][positions[0]]['step_ms']
            for target in results['targets'].values()]
      lines.append(f"| {name} | {draft['parameters'] / 1e6:.2f}M | {variant} | "
                   f"{proposal:.2f} ms | " + ' | '.join(f'{c:.3f}' for c in cs) + ' |')
  int8 = {name: target['int8_draft'] for name, target in results['targets'].items()
          if 'int8_draft' in target}
  if int8:
    lines += ['', "Each target's int8 draft (its own decoder in int8 over its encoding, "
              "jaxspec.Int8Drafter) through the kernel, the target in the CPU's decode layout "
              "(the variant column), interleaved with the target's "
              'steps over 1 and gamma + 1 positions and with iterations of a proposal and '
              'a verify step in a loop (medians over repetitions; "interference": what an '
              'iteration costs beyond its proposal and verify step timed apart); the bytes '
              "a float32 step accesses by XLA's cost analysis:", '',
              '| target | variant | bytes a step | 1-position step | gamma | int8 proposal | c | '
              'verify step | iteration | interference |',
              '|---|---|---|---|---|---|---|---|---|---|']
    for name, draft in int8.items():
      target_variant = draft['target_variant']
      step_bytes = results['targets'][name]['variants'][target_variant][positions[0]]['bytes']
      lines.append(f"| {name} | {target_variant} | {step_bytes / 1e6:.0f} MB | "
                   f"{draft['step_ms']:.2f} ms | "
                   f"{draft['gamma']} | {draft['proposal_ms']:.2f} ms | {draft['c']:.3f} | "
                   f"{draft['verify_ms']:.2f} ms | {draft['iteration_ms']:.2f} ms | "
                   f"{draft['interference_ms']:+.2f} ms |")
  heads = {name: target['feature_head'] for name, target in results['targets'].items()
           if 'feature_head' in target}
  if heads:
    lines += ['', "Each target's feature-level head (jaxspec.FeatureDrafter, int8, random "
              "weights) in the same rounds as its int8 draft: c against the target's "
              'one-position step:', '',
              '| target | head layers | gamma | head proposal | c | int8 draft proposal | c |',
              '|---|---|---|---|---|---|---|']
    for name, head in heads.items():
      lines.append(f"| {name} | {head['layers']} | {head['gamma']} | "
                   f"{head['proposal_ms']:.2f} ms | {head['c']:.3f} | "
                   f"{int8[name]['proposal_ms']:.2f} ms | {int8[name]['c']:.3f} |")
  return '\n'.join(lines) + '\n'


PLOT_STYLES = {'t5x': ':', 'transposed': '--', 'kernel': '-', 'tiled': '-.'}


def plot(results: dict, path: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  figure, axis = plt.subplots(figsize=(6, 4))
  for name, target in results['targets'].items():
    for variant in results['variants']:
      rows = target['variants'][variant]
      ks = sorted(rows)
      axis.plot(ks, [rows[k]['V'] for k in ks], PLOT_STYLES[variant], marker='o',
                label=f'{name} {variant}')
  axis.axhline(1.0, color='gray', linewidth=0.5)
  axis.set_xlabel('positions per decode step (gamma + 1)')
  axis.set_ylabel('V(k) = step(k) / step(1)')
  axis.legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(path, dpi=120)


def main(argv=None):
  args = _parse_args(argv)
  results = measure(args)
  os.makedirs(args.out, exist_ok=True)
  for name, contents in (('step_costs.json', json.dumps(results, indent=1) + '\n'),
                         ('step_costs.md', markdown(results))):
    tmp = os.path.join(args.out, name + '.tmp')
    with open(tmp, 'w') as f:
      f.write(contents)
    os.replace(tmp, os.path.join(args.out, name))
  plot(results, os.path.join(args.out, 'v_of_k.png'))
  print(markdown(results))


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())
