"""docs/benchmarks.md is rendered from results/ (jaxspec.measure.report): the renderer on
a small synthetic results tree, and the committed file against the renderer's output for
the repository's records, so the page cannot go stale."""

import json
import os

import pytest

from jaxspec.launch import render_benchmarks
from jaxspec.measure import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, record):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(record, f)


def _table(text: str, title: str) -> list[dict[str, str]]:
  """The rows of the table under '## title', as {header: cell}."""
  lines = text.split(f'## {title}\n', 1)[1].split('\n## ', 1)[0].splitlines()
  table = [line for line in lines if line.startswith('|')]
  headers = [cell.strip() for cell in table[0].strip('|').split(' | ')]
  return [dict(zip(headers, (cell.strip() for cell in line.strip('|').split(' | '))))
          for line in table[2:]]


@pytest.fixture
def results_tree(tmp_path):
  results = tmp_path / 'results'
  _write(results / 'infer' / 'run' / 'summary.json', {
      'task': 'ende', 'draft': 'int8 target decoder', 'temperature': 0.0, 'gamma': 9,
      'verification': 'coupled', 'examples': 20, 'baseline_seconds': 10.0,
      'speculative_seconds': 4.0, 'baseline_bleu': 30.0, 'speculative_bleu': 30.0,
      'alpha': 0.98765, 'tokens_per_target_call': 6.5, 'speedup': 2.5,
      'identical_outputs': 20,
      'provenance': {'commit': 'abc1234', 'date': '2026-01-02', 'machine': 'Test CPU, 2 cores',
                     'load_average': '1.0-1.5', 'command': 'jaxspec-infer --gin.X=1'}})
  _write(results / 'infer' / 'run' / 'settings.json', {'fingerprint': 'f', 'settings': {}})
  _write(results / 'benchmark' / 'pair' / 'results.json', {
      'task': 'ende', 'target': 'tiny target',
      'machine': {'cpu': 'Other CPU', 'cpu_count': 4, 'date': '2026-02-03'},
      'table2': [{'task': 'ende', 'drafter': 't5 small', 'temperature': 1.0, 'gamma': 3,
                  'alpha': 0.5, 'tokens_per_target_call': 1.75, 'baseline_seconds': 3.0,
                  'speculative_seconds': 2.0, 'speedup': 1.5, 'identical_outputs': 7,
                  'examples': 10, 'repeats': 3}],
      'alpha': [{'drafter': 'bigram', 'temperature': 0.0, 'alpha': 0.25, 'positions': 100,
                 'alpha_by_lenience': {'1.0': 0.25, '0.5': 0.3, '0.3': 0.35, '0.1': 0.4}}]})
  (results / 'notes.json').write_text('not json')
  (results / 'list.json').write_text('[1, 2]')
  return results


def test_renderer_picks_the_records_and_renders_their_rows(results_tree, tmp_path):
  records = report.find_records(str(results_tree))
  kinds = {os.path.relpath(path, results_tree): report.record_kinds(record)
           for path, record in records}
  assert kinds == {os.path.join('benchmark', 'pair', 'results.json'): ['table2', 'alpha'],
                   os.path.join('infer', 'run', 'settings.json'): [],
                   os.path.join('infer', 'run', 'summary.json'): ['runs']}

  text = report.render(str(results_tree), link_base=str(tmp_path / 'docs'))
  assert text.startswith(report.TITLE)
  assert '\n2 records.' in text

  [run] = _table(text, 'Launcher runs: baseline and speculative decoding over a split')
  assert run['task'] == 'ende' and run['T'] == '0' and run['gamma'] == '9'
  assert run['alpha'] == '0.988' and run['tokens per target call'] == '6.50'
  assert run['baseline s'] == '10.0' and run['speculative s'] == '4.0'
  assert run['speedup'] == '2.50x' and run['identical outputs'] == '20 / 20'
  assert run['quality, baseline / speculative'] == 'BLEU 30.00 / 30.00'
  assert (run['machine'], run['date'], run['commit'], run['load average']) == (
      'Test CPU, 2 cores', '2026-01-02', 'abc1234', '1.0-1.5')
  assert run['command'] == '`jaxspec-infer --gin.X=1`'
  assert run['record'] == ('[results/infer/run/summary.json]'
                           '(../results/infer/run/summary.json)')

  [row] = _table(text, 'Table 2: walltime speedup at batch 1 (benchmark)')
  assert (row['target'], row['drafter'], row['T'], row['speedup']) == (
      'tiny target', 't5 small', '1', '1.50x')
  assert row['identical outputs'] == '7 / 10'
  # Without a provenance block: the launcher's machine fields, nothing invented.
  assert (row['machine'], row['date'], row['commit'], row['command']) == (
      'Other CPU, 4 cores', '2026-02-03', '', '')

  [alpha] = _table(text, 'Tables 3 and 5: alpha by drafter and lenience (benchmark)')
  assert (alpha['drafter'], alpha['alpha'], alpha['l=0.5'], alpha['l=0.1']) == (
      'bigram', '0.250', '0.300', '0.400')
  # Kinds no record holds get no section.
  assert '## Beam search against' not in text


def test_launcher_writes_and_checks(results_tree, tmp_path, capsys):
  out = tmp_path / 'docs' / 'benchmarks.md'
  args = [f'--results_dir={results_tree}', f'--out={out}']
  with pytest.raises(SystemExit) as stale:
    render_benchmarks.main(args + ['--check'])
  assert stale.value.code == 1
  render_benchmarks.main(args)
  assert out.read_text() == report.render(str(results_tree), link_base=str(out.parent))
  render_benchmarks.main(args + ['--check'])
  assert 'up to date' in capsys.readouterr().out


def test_committed_benchmarks_md_is_rendered_from_results():
  with open(os.path.join(REPO, 'docs', 'benchmarks.md'), encoding='utf-8') as f:
    committed = f.read()
  rendered = report.render(os.path.join(REPO, 'results'),
                           link_base=os.path.join(REPO, 'docs'))
  assert committed == rendered, ('docs/benchmarks.md is stale: run '
                                 '`python scripts/render_benchmarks.py` and commit it')


def test_files_git_ignores_are_not_records(tmp_path):
  """In a git checkout, what git ignores under results/ (a launcher's run directories) is
  scratch, not a record; a new record not yet committed is one."""
  import subprocess  # pylint: disable=g-import-not-at-top
  subprocess.run(['git', 'init', '-q', str(tmp_path)], check=True)
  (tmp_path / '.gitignore').write_text('/results/batch_sizes/runs/\n')
  record = {'rows': [{'batch_size': 1, 'speculative_tokens_per_second': 2.0}]}
  for path in ('results/batch_sizes/amd.json', 'results/batch_sizes/runs/b1/summary.json'):
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(json.dumps(record))
  found = [os.path.relpath(path, tmp_path) for path, _ in
           report.find_records(str(tmp_path / 'results'))]
  assert found == [os.path.join('results', 'batch_sizes', 'amd.json')]


def test_accelerator_records_render_their_steps_and_end_to_end_rows():
  record = {
      'kind': 'accelerator_bench', 'device': {'device_kind': 'NVIDIA H200'},
      'provenance': {'machine': 'NVIDIA H200 x1 (gpu)', 'date': '2026-11-27',
                     'commit': 'abc1234', 'command': 'jaxspec-accelerator-bench'},
      'parts': {
          'step_costs': {'targets': {'xxl': {'batch_1': {
              'config': 't5_1_1_xxl', 'parameters': 11135332352,
              'steps': {'1': {'ms': 4.08, 'V': 1.0, 'bandwidth_fraction': 0.57},
                        '4': {'ms': 4.0, 'V': 0.98}},
              'small_draft': {'c': 0.11}}}}},
          'end_to_end': {'pair': 'ende_local', 'rows': [
              {'dtype': 'bfloat16', 'decode_positions': 4, 'batch': 8, 'temperature': 0.0,
               'baseline': {'tokens_per_s': 4479.0},
               'speculative': {'tokens_per_s': 3353.0, 'speedup': 0.75, 'alpha': 0.236,
                               'identical_outputs': True}},
              {'dtype': 'float32', 'batch': 1, 'temperature': 0.0, 'error': 'boom'}]}}}
  steps = report._accelerator_step_rows(record)
  assert steps == [{'device': 'NVIDIA H200', 'target': 't5_1_1_xxl', 'parameters': 11135332352,
                    'batch': '1', 'step_ms': 4.08, 'bandwidth': 0.57, 'int8_c': None,
                    'small_c': 0.11, 'V2': None, 'V3': None, 'V4': 0.98, 'V5': None,
                    'V6': None, 'V7': None, 'V8': None, 'V9': None}]
  (row,) = report._accelerator_end_to_end_rows(record)  # the failed row has no speculative
  assert (row['steps'], row['speedup'], row['identical']) == (4, 0.75, True)
  assert report._accelerator_step_rows({'kind': 'other', 'parts': {}}) == []
