"""The measurement records under results/ as markdown tables (docs/benchmarks.md).

Pure Python: walks a results tree for JSON files, recognises the measurement records
among them by their fields (a launcher's run summary, a benchmark's sections, a cost
model, step costs, the peers comparison; settings files and anything else are skipped),
and renders one table per kind. Every row carries its record's provenance: the machine,
the date, the commit that recorded it, the load average and the command, from the
record's `provenance` block where it has one, else from the machine fields the
launchers write (`machine.cpu`, `machine.date`, `cpu`, `date`).

  text = report.render('results', link_base='docs')   # what jaxspec-render-benchmarks writes
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from typing import Any, Callable, Iterable

TITLE = '# Benchmarks: every measurement record in results/'
PROVENANCE_COLUMNS = ('machine', 'date', 'commit', 'load average', 'command', 'record')


@dataclasses.dataclass(frozen=True)
class Column:
  header: str
  value: Callable[[dict], Any]  # row -> a value (None: empty cell)
  fmt: str = ''  # see format_value


@dataclasses.dataclass(frozen=True)
class Kind:
  """One kind of record: which files hold it, its rows, its columns."""
  name: str
  title: str
  description: str
  rows: Callable[[dict], list[dict]]  # record -> rows ([] when the record is not this kind)
  columns: tuple[Column, ...]


def format_value(value, fmt: str = '') -> str:
  """A cell: '' for None; fmt 'x' a ratio (1.65x), 'f1'..'f4' fixed decimals, 'e' two
  significant digits in exponent form, 'ms' seconds as milliseconds, 'g' shortest;
  strings with '|' escaped."""
  if value is None:
    return ''
  if isinstance(value, bool):
    return 'yes' if value else 'no'
  if isinstance(value, (int, float)) and fmt:
    if fmt == 'x':
      return f'{value:.2f}x'
    if fmt.startswith('f'):
      return f'{value:.{int(fmt[1:])}f}'
    if fmt == 'e':
      return f'{value:.1e}'
    if fmt == 'ms':
      return f'{value * 1000:.2f}'
    if fmt == 'g':
      return f'{value:g}'
  if isinstance(value, float):
    return f'{value:.3f}'
  return str(value).replace('|', '\\|').replace('\n', ' ')


def _get(*keys):
  """row -> row[k0][k1]..., None where any is missing."""
  def value(row):
    for key in keys:
      if not isinstance(row, dict) or key not in row:
        return None
      row = row[key]
    return row
  return value


def _of(count_key: str, total_key: str):
  """row -> 'count / total'."""
  def value(row):
    if row.get(count_key) is None:
      return None
    return f'{row[count_key]} / {row[total_key]}' if row.get(total_key) is not None \
        else str(row[count_key])
  return value


def _quality(prefix_a: str, prefix_b: str):
  """row -> 'BLEU a / b' or 'ROUGE-1/2/Lsum a / b' from <prefix>_bleu or _rouge* fields."""
  def value(row):
    if row.get(f'{prefix_a}_bleu') is not None:
      return f'BLEU {row[f"{prefix_a}_bleu"]:.2f} / {row[f"{prefix_b}_bleu"]:.2f}'
    if row.get(f'{prefix_a}_rouge1') is not None:
      def rouge(prefix):
        return '/'.join(f'{row[f"{prefix}_{k}"]:.2f}' for k in ('rouge1', 'rouge2', 'rougeLsum'))
      return f'ROUGE-1/2/Lsum {rouge(prefix_a)} vs {rouge(prefix_b)}'
    return None
  return value


def _section(key: str):
  """record -> its list section `key`, each row with the record's target."""
  def rows(record):
    section = record.get(key)
    if not isinstance(section, list) or not all(isinstance(r, dict) for r in section):
      return []
    return [dict(row, _target=record.get('target')) for row in section]
  return rows


def _top_level(*required: str):
  """record -> [record] where it has every required field."""
  def rows(record):
    return [record] if all(key in record for key in required) else []
  return rows


def _beam_rows(record):
  beam = record.get('beam')
  return [dict(beam, _target=record.get('target'))] if isinstance(beam, dict) else []


def _sweep_rows(record):
  sweep = record.get('sweep')
  if not isinstance(sweep, dict):
    return []
  head = {k: v for k, v in sweep.items() if k != 'rows'}
  return [dict(head, **row, _target=record.get('target')) for row in sweep.get('rows', [])]


def _cost_alpha_rows(record):
  if not ('baseline_costs' in record and isinstance(record.get('drafts'), list)):
    return []
  run = record.get('run', {})
  rows = []
  for draft in record['drafts']:
    alphas = draft.get('required_alpha', {})
    rows.append(dict(
        draft, _run=run, _speedup=record.get('speedup'),
        _alphas=', '.join(f'gamma {gamma}: ' + ('-' if a is None else f'{a:.3f}')
                          for gamma, a in alphas.items())))
  return rows


def _step_cost_rows(record):
  targets = record.get('targets')
  if not (isinstance(targets, dict) and 'roofline' in record):
    return []
  rows = []
  for name, target in targets.items():
    variants = target.get('variants', {})
    t5x_step = _get('t5x', '1', 'step_ms')(variants)
    for variant, by_positions in variants.items():
      step = _get('1', 'step_ms')(by_positions)
      row = {'target': name, 'parameters': target.get('parameters'), 'variant': variant,
             'step_ms': step, 'roofline': _get('1', 'memory_roofline_fraction')(by_positions),
             'vs_t5x': step / t5x_step if step and t5x_step else None}
      for k in range(2, 10):
        row[f'V{k}'] = _get(str(k), 'V')(by_positions)
      rows.append(row)
  return rows


def _int8_step_rows(record):
  targets = record.get('targets')
  if not (isinstance(targets, dict) and 'roofline' in record):
    return []
  return [dict(target['int8_draft'], target=name, parameters=target.get('parameters'),
               bytes=_get('variants', target['int8_draft'].get('target_variant', 'kernel'), '1',
                          'bytes')(target))
          for name, target in targets.items() if isinstance(target.get('int8_draft'), dict)]


def _draft_proposal_rows(record):
  drafts = record.get('drafts')
  if not (isinstance(drafts, dict) and 'roofline' in record):
    return []
  return [dict(draft, draft=name, gamma=record.get('gamma')) for name, draft in drafts.items()]


def _peer_rows(record):
  if not (isinstance(record.get('decoders'), list) and 'ratios' in record):
    return []
  return list(record['decoders'])


def _millions(value):
  return None if value is None else f'{value / 1e6:.1f}M'


def _megabytes(value):
  return None if value is None else f'{value / 1e6:.0f} MB'


_TARGET = Column('target', _get('_target'))
_T = Column('T', _get('temperature'), 'g')


def _accelerator_part(record, name: str) -> tuple[dict, Any]:
  """(part `name` of a jaxspec-accelerator-bench record, or {}; the device's kind)."""
  if record.get('kind') != 'accelerator_bench':
    return {}, None
  return ((record.get('parts') or {}).get(name) or {},
          (record.get('device') or {}).get('device_kind'))


def _accelerator_step_rows(record):
  """jaxspec-accelerator-bench part a: a row per (target, batch) with a one-position step."""
  part, device = _accelerator_part(record, 'step_costs')
  rows = []
  for entry in (part.get('targets') or {}).values():
    for batch_key, measured in entry.items():
      steps = measured.get('steps') or {} if isinstance(measured, dict) else {}
      one = steps.get('1') or steps.get(1)
      if not one:
        continue
      row = {'device': device, 'target': measured.get('config'),
             'parameters': measured.get('parameters'), 'batch': batch_key.split('_')[-1],
             'step_ms': one.get('ms'), 'bandwidth': one.get('bandwidth_fraction'),
             'int8_c': (measured.get('int8_draft') or {}).get('c'),
             'small_c': (measured.get('small_draft') or {}).get('c')}
      row.update({f'V{k}': (steps.get(str(k)) or {}).get('V') for k in range(2, 10)})
      rows.append(row)
  return rows


def _accelerator_end_to_end_rows(record):
  """jaxspec-accelerator-bench part d: a row per (dtype, step width, batch, T)."""
  part, device = _accelerator_part(record, 'end_to_end')
  rows = []
  for row in part.get('rows') or []:
    if 'speculative' not in row:
      continue
    spec = row['speculative']
    rows.append({'device': device, 'pair': part.get('pair'), 'dtype': row.get('dtype'),
                 'steps': row.get('decode_positions') or '-', 'batch': row.get('batch'),
                 'temperature': row.get('temperature'),
                 'baseline': row['baseline'].get('tokens_per_s'),
                 'speculative': spec.get('tokens_per_s'), 'speedup': spec.get('speedup'),
                 'alpha': spec.get('alpha'), 'identical': spec.get('identical_outputs')})
  return rows


def _rows_with(*required: str):
  """record -> its 'rows', where there are some and each has every required field."""
  def rows(record):
    found = record.get('rows')
    if not isinstance(found, list) or not found or not all(
        isinstance(r, dict) and all(key in r for key in required) for r in found):
      return []
    return found
  return rows


KINDS: tuple[Kind, ...] = (
    Kind('batch_sizes', 'The main job at each batch size (jaxspec-batch-sizes)',
         'Baseline and speculative decoding (`gamma=\'auto\'`: chosen per batch from measured '
         'costs, 0 = the baseline itself) interleaved batch by batch in one process; tokens '
         'per second over the same outputs; the gammas chosen, as gamma:batches.',
         _rows_with('batch_size', 'speculative_tokens_per_second'),
         (Column('batch', _get('batch_size')), Column('temperature', _get('temperature')),
          Column('examples', _get('examples')),
          Column('baseline tokens/s', _get('baseline_tokens_per_second'), 'f1'),
          Column('speculative tokens/s', _get('speculative_tokens_per_second'), 'f1'),
          Column('speedup', _get('speedup'), 'x'),
          Column('gamma chosen', _get('gamma_choices')),
          Column('alpha', _get('alpha'), 'f3'),
          Column('identical outputs', _get('identical_outputs')))),
    Kind('staged', 'Staged against single-stage speculation (jaxspec-staged-bench)',
         'The baseline, the int8 draft alone and the int8 draft staged on the small T5 draft '
         '(lookahead k) interleaved example by example, batch 1, coupled verification; gain '
         'over single stage measured and predicted from the parts\' costs timed apart; '
         'drafter steps and rounds over all examples; the proposals\' acceptance.',
         _rows_with('decoder', 'tokens_per_second'),
         (_T, Column('gamma', _get('gamma')), Column('decoder', _get('decoder')),
          Column('tokens/s', _get('tokens_per_second'), 'f1'),
          Column('speedup', _get('speedup'), 'x'),
          Column('gain over single stage', _get('gain_over_single_stage'), 'x'),
          Column('predicted gain', _get('predicted_gain'), 'x'),
          Column('drafter steps', _get('drafter_steps')), Column('rounds', _get('rounds')),
          Column('acceptance', _get('stage_acceptance'), 'f3'),
          Column('alpha', _get('alpha'), 'f3'),
          Column('identical outputs', _get('identical_outputs')))),
    Kind('runs', 'Launcher runs: baseline and speculative decoding over a split',
         'A `jaxspec-infer` summary: both decoders over the same examples, walltime speedup '
         '(sum of the baseline\'s calls over the sum of speculative decoding\'s), quality '
         'of both, outputs identical token for token.',
         _top_level('baseline_seconds', 'speculative_seconds', 'identical_outputs'),
         (Column('task', _get('task')), Column('draft', _get('draft')), _T,
          Column('gamma', _get('gamma')), Column('verification', _get('verification')),
          Column('alpha', _get('alpha'), 'f3'),
          Column('tokens per target call', _get('tokens_per_target_call'), 'f2'),
          Column('baseline s', _get('baseline_seconds'), 'f1'),
          Column('speculative s', _get('speculative_seconds'), 'f1'),
          Column('speedup', _get('speedup'), 'x'),
          Column('quality, baseline / speculative', _quality('baseline', 'speculative')),
          Column('identical outputs', _of('identical_outputs', 'examples')))),
    Kind('beam_runs', 'Launcher runs: beam search and speculative beam search over a split',
         'A `jaxspec-infer` beam summary. speedup: beam search\'s walltime over speculative '
         'beam search\'s (below 1: speculative beam search is slower).',
         _top_level('beam_seconds', 'speculative_beam_seconds', 'identical_beam_tokens'),
         (Column('task', _get('task')), Column('draft', _get('draft')),
          Column('beams w', _get('num_beams')), Column('draft beams u', _get('draft_beams')),
          Column('gamma', _get('beam_gamma')),
          Column('tokens identical', _of('identical_beam_tokens', 'examples')),
          Column('scores bit-identical', _get('identical_beam_tokens_and_scores')),
          Column('largest score difference', _get('max_beam_score_difference'), 'e'),
          Column('target calls a token, plain', _get('beam_target_calls_per_token'), 'f2'),
          Column('speculative', _get('speculative_beam_target_calls_per_token'), 'f2'),
          Column('search steps per call', _get('search_steps_per_target_call'), 'f3'),
          Column('quality, both', _quality('beam', 'speculative_beam')),
          Column('speedup', _get('beam_speedup'), 'x'))),
    Kind('table2', 'Table 2: walltime speedup at batch 1 (benchmark)',
         '`jaxspec-benchmark` section `table2`: baseline and speculative decoding interleaved '
         'in one process, median of the repeats over the first examples of the test split. '
         'identical outputs: all at temperature 0; sampled outputs are other draws of the '
         'same distribution.',
         _section('table2'),
         (_TARGET, Column('drafter', _get('drafter')), _T, Column('gamma', _get('gamma')),
          Column('alpha', _get('alpha'), 'f3'),
          Column('tokens per target call', _get('tokens_per_target_call'), 'f2'),
          Column('baseline s', _get('baseline_seconds'), 'f2'),
          Column('speculative s', _get('speculative_seconds'), 'f2'),
          Column('speedup', _get('speedup'), 'x'),
          Column('identical outputs', _of('identical_outputs', 'examples')),
          Column('repeats', _get('repeats')))),
    Kind('alpha', 'Tables 3 and 5: alpha by drafter and lenience (benchmark)',
         '`jaxspec-benchmark` section `alpha`: Corollary 3.6\'s estimate, teacher forced on '
         'the target\'s own outputs, every position through EOS. l < 1 (lenience) changes '
         'the output.',
         _section('alpha'),
         (_TARGET, Column('drafter', _get('drafter')), _T,
          Column('alpha', _get('alpha'), 'f3'), Column('positions', _get('positions')),
          Column('l=0.5', _get('alpha_by_lenience', '0.5'), 'f3'),
          Column('l=0.3', _get('alpha_by_lenience', '0.3'), 'f3'),
          Column('l=0.1', _get('alpha_by_lenience', '0.1'), 'f3'))),
    Kind('table4', 'Table 4: costs and predicted speedups (benchmark)',
         'c: a draft step over a target step; verify cost: a target step over gamma + 1 '
         'positions over a one-position step; Theorem 3.8 takes the verify cost as 1; '
         '"predicted" uses the measured step and proposal times; "measured" is Table 2\'s.',
         _section('table4'),
         (_TARGET, Column('drafter', _get('drafter')), _T, Column('gamma', _get('gamma')),
          Column('alpha', _get('alpha'), 'f3'), Column('c', _get('c'), 'f3'),
          Column('verify cost', _get('verify_cost'), 'f2'),
          Column('Theorem 3.8', _get('theorem_3_8_speedup'), 'x'),
          Column('predicted', _get('measured_cost_speedup'), 'x'),
          Column('measured', _get('empirical_speedup'), 'x'))),
    Kind('options', 'Verification options side by side (benchmark)',
         '`jaxspec-benchmark` section `options`: the same examples and keys, every option and '
         'the baseline interleaved example by example; ratios of median totals.',
         _section('options'),
         (_TARGET, Column('drafter', _get('drafter')), _T, Column('option', _get('option')),
          Column('gamma', _get('gamma')),
          Column('tokens per target call', _get('tokens_per_target_call'), 'f3'),
          Column('alpha', _get('alpha'), 'f3'),
          Column('drafted per iteration', _get('drafted_per_iteration'), 'f2'),
          Column('vs plain', _get('speedup_vs_plain'), 'x'),
          Column('vs baseline', _get('speedup_vs_baseline'), 'x'),
          Column('examples', _get('examples')))),
    Kind('beam', 'Beam search against speculative beam search (benchmark)',
         '`jaxspec-benchmark` section `beam`, batch 1, interleaved example by example. '
         'speedup: beam search\'s walltime over speculative beam search\'s.',
         _beam_rows,
         (_TARGET, Column('drafter', _get('drafter')), Column('beams w', _get('num_beams')),
          Column('draft beams u', _get('draft_beams')), Column('gamma', _get('gamma')),
          Column('tokens identical', _of('identical_tokens', 'examples')),
          Column('scores bit-identical', _get('identical_tokens_and_scores')),
          Column('largest score difference', _get('max_score_difference'), 'e'),
          Column('search steps per call', _get('search_steps_per_target_call'), 'f3'),
          Column('speedup', _get('speedup'), 'x'))),
    Kind('sweep', 'Figure 3: speedup by gamma (benchmark)',
         '`jaxspec-benchmark` section `sweep`.',
         _sweep_rows,
         (_TARGET, Column('drafter', _get('drafter')), _T, Column('alpha', _get('alpha'), 'f3'),
          Column('c', _get('c'), 'f3'), Column('gamma', _get('gamma')),
          Column('measured', _get('measured_speedup'), 'x'),
          Column('Theorem 3.8', _get('theorem_3_8_speedup'), 'x'),
          Column('predicted', _get('measured_cost_speedup'), 'x'))),
    Kind('batch', 'Batch sizes (benchmark)', '`jaxspec-benchmark` section `batch`.',
         _section('batch'),
         (_TARGET, Column('batch size', _get('batch_size')), Column('drafter', _get('drafter')),
          Column('gamma', _get('gamma')),
          Column('baseline tokens/s', _get('baseline_tokens_per_second'), 'f1'),
          Column('speculative tokens/s', _get('speculative_tokens_per_second'), 'f1'),
          Column('speedup', _get('speedup'), 'x'), Column('examples', _get('examples')))),
    Kind('reference', 'The baseline against a T5X-style loop (benchmark)',
         '`jaxspec-benchmark` section `reference`: a loop that projects the cross-attention '
         'keys and values at every step, as T5X\'s decoding does.',
         _section('reference'),
         (_TARGET, _T, Column('T5X-style s', _get('t5x_style_seconds'), 'f3'),
          Column('baseline s', _get('baseline_seconds'), 'f3'),
          Column('baseline speedup', _get('baseline_speedup'), 'x'),
          Column('identical outputs', _of('identical_outputs', 'examples')))),
    Kind('cost_model', 'Cost models fitted to launcher runs',
         '`jaxspec-cost-model`: per-example milliseconds by least squares over a run\'s '
         'records, and the least alpha a draft needs for the speedup asked, for drafts and '
         'iterations costing the given fractions of the run\'s (-: not even at alpha 1).',
         _cost_alpha_rows,
         (Column('task', _get('_run', 'task')), Column('draft', _get('_run', 'draft')),
          Column('T', _get('_run', 'temperature'), 'g'),
          Column('run gamma', _get('_run', 'gamma')),
          Column('run alpha', _get('_run', 'alpha'), 'f3'),
          Column('run speedup', _get('_run', 'speedup'), 'x'),
          Column('target call ms', _get('per_call_ms'), 'f2'),
          Column('drafted token ms', _get('per_draft_ms'), 'f3'),
          Column('for speedup', _get('_speedup'), 'x'),
          Column('least alpha', _get('_alphas')))),
    Kind('step_costs', 'Step costs: V(k) by kernel layout',
         '`jaxspec-step-costs`: a cached decode step over k positions against one position, '
         'random weights, every variant interleaved. t5x: kernels [in, out] with XLA\'s '
         'matmuls; transposed: [out, in] with XLA\'s; kernel: [out, in] through jaxspec\'s '
         'CPU kernel; tiled: [out / 16, in, 16] through the kernel (AVX-512 only). '
         'roofline: the one-position step\'s bytes over the machine\'s measured '
         'stream bandwidth.',
         _step_cost_rows,
         (Column('target', _get('target')), Column('parameters', lambda r: _millions(r.get('parameters'))),
          Column('variant', _get('variant')), Column('1-position step ms', _get('step_ms'), 'f2'),
          Column('vs t5x', _get('vs_t5x'), 'f2'), Column('roofline', _get('roofline'), 'f2'))
         + tuple(Column(f'V({k})', _get(f'V{k}'), 'f2') for k in range(2, 10))),
    Kind('int8_step_costs', 'Step costs: the int8 draft against its target',
         '`jaxspec-step-costs` with `--int8_gamma`: the target\'s own decoder in int8 as the '
         'draft; an iteration is a proposal and a verify step in a loop, interference what '
         'it costs beyond the two timed apart.',
         _int8_step_rows,
         (Column('target', _get('target')), Column('parameters', lambda r: _millions(r.get('parameters'))),
          Column('bytes a step', lambda r: _megabytes(r.get('bytes'))),
          Column('gamma', _get('gamma')), Column('step ms', _get('step_ms'), 'f2'),
          Column('verify ms', _get('verify_ms'), 'f2'),
          Column('proposal ms', _get('proposal_ms'), 'f2'), Column('c', _get('c'), 'f3'),
          Column('iteration ms', _get('iteration_ms'), 'f2'),
          Column('interference ms', _get('interference_ms'), 'f2'))),
    Kind('draft_proposals', 'Step costs: T5 drafts\' proposals',
         '`jaxspec-step-costs`: a proposal of gamma tokens, by kernel layout.',
         _draft_proposal_rows,
         (Column('draft', _get('draft')), Column('parameters', lambda r: _millions(r.get('parameters'))),
          Column('gamma', _get('gamma')),
          Column('t5x ms', _get('proposal_ms', 't5x'), 'f3'),
          Column('transposed ms', _get('proposal_ms', 'transposed'), 'f3'),
          Column('kernel ms', _get('proposal_ms', 'kernel'), 'f3'))),
    Kind('accelerator_steps', 'Accelerator: step costs at T5.1.1 shapes (jaxspec-accelerator-bench)',
         'Part a: a cached decode step in bfloat16 with random weights, one position and k '
         'positions (V(k) = step(k) / step(1)); bandwidth: the bytes a step reads over its '
         'time and the device\'s peak; c: the int8 self-draft\'s and T5.1.1-small\'s step '
         'over the target\'s.',
         _accelerator_step_rows,
         (Column('device', _get('device')), Column('target', _get('target')),
          Column('parameters', lambda r: _millions(r.get('parameters'))),
          Column('batch', _get('batch')), Column('step ms', _get('step_ms'), 'f3'),
          Column('bandwidth', _get('bandwidth'), 'f2'))
         + tuple(Column(f'V({k})', _get(f'V{k}'), 'f2') for k in (2, 4, 6, 8, 9))
         + (Column('int8 c', _get('int8_c'), 'f3'), Column('small c', _get('small_c'), 'f3'))),
    Kind('accelerator_end_to_end', 'Accelerator: end to end (jaxspec-accelerator-bench)',
         'Part d: the baseline and speculative decoding with the pair\'s small draft '
         'interleaved; steps: the target\'s fixed step width (T5Config.decode_positions; '
         '- : each step as wide as its tokens); identical: greedy outputs token for token '
         'the baseline\'s.',
         _accelerator_end_to_end_rows,
         (Column('device', _get('device')), Column('pair', _get('pair')),
          Column('dtype', _get('dtype')), Column('steps', _get('steps')),
          Column('batch', _get('batch')), _T,
          Column('baseline tokens/s', _get('baseline'), 'f0'),
          Column('speculative tokens/s', _get('speculative'), 'f0'),
          Column('speedup', _get('speedup'), 'x'), Column('alpha', _get('alpha'), 'f3'),
          Column('identical', _get('identical')))),
    Kind('peers', 'Peers: transformers\' greedy and assisted generation on the same weights',
         '`jaxspec-bench-peers`: every decoder greedy on the same examples, batch 1, median of '
         'the repeats.',
         _peer_rows,
         (Column('decoder', _get('decoder')), Column('tokens', _get('tokens')),
          Column('median s', _get('median_seconds'), 'f2'),
          Column('tokens/s', _get('tokens_per_second'), 'f1'),
          Column('identical to hf_greedy', _get('identical_to_hf_greedy')),
          Column('tokens per target call', _get('tokens_per_target_call'), 'f2'),
          Column('compile s', _get('compile_seconds'), 'f2'))),
)


def provenance(record: dict) -> dict:
  """machine, date, commit, load average and command of a record: its `provenance` block,
  else what the launchers' machine fields say ('' where nothing does)."""
  given = record.get('provenance') if isinstance(record.get('provenance'), dict) else {}
  machine = record.get('machine') if isinstance(record.get('machine'), dict) else {}
  cpu = machine.get('cpu') or record.get('cpu')
  cores = machine.get('cpu_count') or machine.get('cores')
  fallback_machine = f'{cpu}, {cores} cores' if cpu and cores else (cpu or record.get('device'))
  described = given.get('machine')
  if isinstance(described, dict):  # a launcher's machine description
    caches = described.get('caches') or {}
    described = ', '.join(str(part) for part in (
        described.get('cpu') or described.get('device'),
        described.get('cores') and f"{described['cores']} cores",
        caches.get('L3') and f"L3 {caches['L3']}") if part)
  return {
      'machine': described or fallback_machine or '',
      'date': given.get('date') or machine.get('date') or record.get('date') or '',
      'commit': given.get('commit') or '',
      'load average': given.get('load_average') or '',
      'command': given.get('command') or '',
  }


def find_records(results_dir: str) -> list[tuple[str, dict]]:
  """(path, record) of every JSON object under results_dir, sorted by path; in a git
  checkout only the files git does not ignore (a launcher's run directories and other
  scratch output under results/ are not records)."""
  found = []
  for path in _result_files(results_dir):
    try:
      with open(path, encoding='utf-8') as f:
        record = json.load(f)
    except (OSError, ValueError):
      continue
    if isinstance(record, dict):
      found.append((path, record))
  return sorted(found, key=lambda item: item[0])


def _result_files(results_dir: str) -> list[str]:
  """The .json files under results_dir: those git tracks or would track, where it runs."""
  try:
    listed = subprocess.run(
        ['git', 'ls-files', '--cached', '--others', '--exclude-standard', '-z', '.'],
        cwd=results_dir, capture_output=True, check=True).stdout.decode()
    return [os.path.join(results_dir, name) for name in listed.split('\0')
            if name.endswith('.json')]
  except (OSError, subprocess.CalledProcessError):  # not a git checkout, or no git
    return [os.path.join(directory, name)
            for directory, _, files in os.walk(results_dir)
            for name in files if name.endswith('.json')]


def record_kinds(record: dict) -> list[str]:
  """The kinds a record holds rows of ([]: not a measurement record)."""
  return [kind.name for kind in KINDS if kind.rows(record)]


def _cell_code(text: str) -> str:
  return f'`{text}`' if text else ''


def render_kind(kind: Kind, records: Iterable[tuple[str, dict]], results_dir: str,
                link_base: str) -> str:
  """The markdown section of one kind ('' when no record holds it): a row per row of
  each record, named by its path from results_dir's parent, linked from link_base."""
  lines = []
  for path, record in records:
    rows = kind.rows(record)
    if not rows:
      continue
    origin = provenance(record)
    link = os.path.relpath(path, link_base).replace(os.sep, '/')
    name = os.path.relpath(path, os.path.dirname(os.path.abspath(results_dir)))
    record_cell = f'[{name.replace(os.sep, "/")}]({link})'
    for row in rows:
      cells = [format_value(column.value(row), column.fmt) for column in kind.columns]
      cells += [format_value(origin['machine']), format_value(origin['date']),
                format_value(origin['commit']), format_value(origin['load average']),
                _cell_code(format_value(origin['command'])), record_cell]
      lines.append('| ' + ' | '.join(cells) + ' |')
  if not lines:
    return ''
  headers = [column.header for column in kind.columns] + list(PROVENANCE_COLUMNS)
  return '\n'.join([f'## {kind.title}', '', kind.description, '',
                    '| ' + ' | '.join(headers) + ' |',
                    '|' + '---|' * len(headers)] + lines) + '\n'


def render(results_dir: str, link_base: str = '.') -> str:
  """docs/benchmarks.md's text for the records under results_dir; links to the records
  are relative to link_base (the directory the markdown file is written to)."""
  records = find_records(results_dir)
  sections = [text for kind in KINDS if (text := render_kind(kind, records, results_dir, link_base))]
  recognised = sum(1 for _, record in records if record_kinds(record))
  header = '\n'.join([
      TITLE, '',
      'Generated from the JSON records under `results/` by `jaxspec-render-benchmarks` '
      '(`python scripts/render_benchmarks.py`; `--check` fails when this file is stale). '
      'Do not edit it by hand: add or fix a record and render again.', '',
      f'{recognised} records. Every row names its record and where it was measured: the '
      'machine, the date, the commit that recorded it, the load average (1 minute, the '
      'run\'s own threads included) where it was noted, and the command that produced it '
      '(as run then: `python scripts/X.py` is `jaxspec-X` today). Walltime ratios on a '
      'shared 2-core machine move by several percent from run to run; compare rows only '
      'within one machine.', ''])
  return header + '\n' + '\n'.join(sections)
