"""Per-example costs of a main-job run, and the alpha a draft needs for a speedup.

  python scripts/cost_model.py --run_dir=results/infer/ende54m_int8
  python scripts/cost_model.py --run_dir=DIR --speedup=2 --draft_costs=1,0.5,0.25 --gammas=4,6,9

Reads the run's baseline.jsonl, speculative.jsonl and summary.json (written by
scripts/infer.py with both decoders), fits each decoder's per-example milliseconds by
least squares (jaxspec.measure.cost_model: the baseline's fixed cost and cost a token;
speculative decoding's fixed cost, cost a target call and cost a drafted token), checks
the model against the run (its expected speedup at the run's alpha and gamma beside the
measured one; with gamma='auto', the gamma every example took), and prints, for drafts
costing each given fraction of the fitted cost a drafted token (a draft with half the
layers: about 0.5) and iterations costing each
fraction in --call_costs of the fitted cost a target call (a cheaper verify step), the
least alpha that reaches --speedup at each of --gammas. The cost a call is the run's,
whose verify steps span at most its gamma + 1 positions: gammas above the run's verify
more positions a call than the fit has seen and are charged too little. Writes
<run_dir>/cost_model.json and cost_model.md unless --out says elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from jaxspec.measure import cost_model
from jaxspec import errors, inference
from jaxspec.validation import AUTO_GAMMA
from jaxspec.launch import command


def _parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--run_dir', required=True,
                      help="an output directory of scripts/infer.py with both decoders")
  parser.add_argument('--speedup', type=float, default=2.0)
  parser.add_argument('--gammas', default='4,6,8,9')
  parser.add_argument('--draft_costs', default='1,0.75,0.5,0.25,0.1',
                      help="drafts' cost a drafted token, as fractions of the run's")
  parser.add_argument('--call_costs', default='1',
                      help="iterations' cost a target call, as fractions of the run's")
  parser.add_argument('--out', default='', help='directory for the outputs (--run_dir)')
  command.add_verbose_flag(parser)
  return parser.parse_args(argv)


def _numbers(text: str, kind):
  values = [kind(v) for v in text.split(',') if v]
  if not values:
    raise errors.InvalidSetting(f'expected a comma-separated list, got {text!r}')
  return values


def _records(run_dir: str, decoder: str) -> dict[int, dict]:
  """{example index: record} of one decoder's records, read as the launcher resumes them."""
  path = os.path.join(run_dir, f'{decoder}.jsonl')
  if not os.path.exists(path):
    raise errors.MissingFile(f'{path} not found: --run_dir must hold a run of scripts/infer.py '
                             'with the baseline and speculative decoders')
  return inference.ResumableJsonl(path).records


def load_run(run_dir: str) -> dict:
  """{'lengths', 'baseline_ms', 'calls', 'drafts', 'speculative_ms' (per example), 'summary'}."""
  baseline = _records(run_dir, 'baseline')
  speculative = _records(run_dir, 'speculative')
  if set(baseline) != set(speculative):
    raise errors.InvalidSetting(f'{run_dir}: the baseline and speculative records cover '
                                'different examples (an interrupted run?); rerun it to '
                                'completion')
  indices = sorted(baseline)
  if any(baseline[i]['batch_start'] != i for i in indices):
    raise errors.InvalidSetting(f'{run_dir}: batches of more than one example; the cost model '
                                'is per example (run with batch size 1)')
  with open(os.path.join(run_dir, 'summary.json')) as f:
    summary = json.load(f)
  column = lambda records, field: np.array([records[i][field] for i in indices])  # noqa: E731
  return {
      'lengths': np.array([len(baseline[i]['tokens']) for i in indices]),
      'baseline_ms': 1e3 * column(baseline, 'batch_seconds'),
      'calls': column(speculative, 'target_calls'),
      'drafts': column(speculative, 'batch_verified_positions'),
      'speculative_ms': 1e3 * column(speculative, 'batch_seconds'),
      'gamma': run_gamma(run_dir, summary, [speculative[i] for i in indices]),
      'summary': summary,
  }


def run_gamma(run_dir: str, summary: dict, records) -> int:
  """The one gamma the run decoded with: its setting, or with gamma='auto' the gamma its
  records say every example took (the fit is of one gamma's calls and drafts)."""
  if summary.get('gamma') != AUTO_GAMMA:
    return summary['gamma']
  chosen = {record.get('gamma') for record in records}
  gamma = chosen.pop() if len(chosen) == 1 else None
  if not isinstance(gamma, int) or gamma < 1:
    taken = summary.get('gamma_choices', 'see its records')
    raise errors.InvalidSetting(f"{run_dir}: gamma='auto' decoded with more than one gamma or "
                                f'the baseline ({taken}); the cost model fits one gamma: rerun '
                                'the job with --gin.GAMMA=<the gamma to fit>')
  return gamma


def analyse(run: dict, speedup: float, gammas, draft_costs, call_costs=(1.0,)) -> dict:
  baseline = cost_model.fit_baseline_costs(run['lengths'], run['baseline_ms'])
  speculative = cost_model.fit_speculative_costs(run['calls'], run['drafts'],
                                                 run['speculative_ms'])
  summary = run['summary']
  modelled = cost_model.expected_speedup(summary['alpha'], run['gamma'], run['lengths'],
                                         baseline, speculative)
  rows = []
  for call_fraction in call_costs:
    for fraction in draft_costs:
      costs = dataclasses.replace(speculative, per_draft_ms=fraction * speculative.per_draft_ms,
                                  per_call_ms=call_fraction * speculative.per_call_ms)
      rows.append({'draft_cost_fraction': fraction, 'per_draft_ms': costs.per_draft_ms,
                   'call_cost_fraction': call_fraction, 'per_call_ms': costs.per_call_ms,
                   'required_alpha': {str(g): cost_model.required_alpha(
                       speedup, g, run['lengths'], baseline, costs) for g in gammas}})
  return {
      'run': {**{key: summary.get(key) for key in ('task', 'draft', 'temperature', 'alpha',
                                                   'speedup', 'examples')},
              'gamma': run['gamma'], 'gamma_setting': summary.get('gamma')},
      'mean_output_tokens': float(run['lengths'].mean()),
      'mean_target_calls': float(run['calls'].mean()),
      'mean_drafts': float(run['drafts'].mean()),
      'baseline_costs': dataclasses.asdict(baseline),
      'speculative_costs': dataclasses.asdict(speculative),
      'modelled_speedup_at_run': modelled,
      'speedup': speedup,
      'drafts': rows,
  }


def markdown(result: dict) -> str:
  run, base, spec = result['run'], result['baseline_costs'], result['speculative_costs']
  gammas = list(result['drafts'][0]['required_alpha'])
  lines = [
      f"Run: {run['task']}, {run['draft']}, temperature {run['temperature']}, gamma "
      f"{run['gamma']}, {run['examples']} examples: alpha {run['alpha']:.3f}, measured "
      f"speedup {run['speedup']:.3f}x; the model at that alpha and gamma: "
      f"{result['modelled_speedup_at_run']:.3f}x.",
      '',
      f"Baseline: {base['fixed_ms']:.2f} ms + {base['per_token_ms']:.3f} ms a token "
      f"({result['mean_output_tokens']:.2f} tokens an example). Speculative: "
      f"{spec['fixed_ms']:.2f} ms + {spec['per_call_ms']:.2f} ms a target call + "
      f"{spec['per_draft_ms']:.3f} ms a drafted token ({result['mean_target_calls']:.2f} "
      f"calls, {result['mean_drafts']:.2f} drafts an example).",
      '',
      f"Least alpha for {result['speedup']:g}x (— : not even at alpha 1):",
      '',
      '| cost a target call | cost a drafted token | '
      + ' | '.join(f'gamma {g}' for g in gammas) + ' |',
      '|---|---|' + '---|' * len(gammas),
  ]
  for row in result['drafts']:
    cells = ['—' if a is None else f'{a:.3f}' for a in row['required_alpha'].values()]
    lines.append(f"| {row['per_call_ms']:.2f} ms ({row['call_cost_fraction']:g} x) | "
                 f"{row['per_draft_ms']:.3f} ms ({row['draft_cost_fraction']:g} x) | "
                 + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def main(argv=None):
  args = _parse_args(argv)
  gammas = _numbers(args.gammas, int)
  draft_costs = _numbers(args.draft_costs, float)
  result = analyse(load_run(args.run_dir), args.speedup, gammas, draft_costs,
                   _numbers(args.call_costs, float))
  text = markdown(result)
  out = args.out or args.run_dir
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'cost_model.json'), 'w') as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(out, 'cost_model.md'), 'w') as f:
    f.write(text)
  sys.stdout.write(text)


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())
