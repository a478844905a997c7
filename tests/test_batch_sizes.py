"""jaxspec-batch-sizes end to end on the tiny random pair: one row per batch size and
temperature, the JSON and markdown rewritten after each run, the plot at the end."""

import json
import shutil

import gin

from jaxspec.launch import batch_sizes
from test_scripts import _infer_config  # the launcher config of the tiny random pair


def test_rows_per_batch_size_with_auto_gamma(tmp_path, tiny_pair_checkpoints):
  for name in ('target', 'draft'):
    shutil.copytree(tiny_pair_checkpoints / name, tmp_path / name)
  config = tmp_path / 'config.gin'
  config.write_text(_infer_config(tmp_path))
  record = batch_sizes.run(
      gin_file=str(config), batch_sizes=[1, 2], temperatures=[0.0], num_examples=4,
      output_dir=str(tmp_path / 'results'), name='tiny',
      extra_flags=["--gin.GAMMA='auto'", '--gin.infer.auto_gammas=(1, 2)',
                   f"--gin.infer.calibration_dir='{tmp_path / 'calibration'}'"])
  gin.clear_config()
  assert [(r['batch_size'], r['temperature']) for r in record['rows']] == [(1, 0.0), (2, 0.0)]
  for row in record['rows']:
    assert row['identical_outputs'] == '4/4'
    assert row['baseline_tokens_per_second'] > 0 and row['speculative_tokens_per_second'] > 0
    assert abs(row['speedup'] - row['speculative_tokens_per_second']
               / row['baseline_tokens_per_second']) < 1e-9
    assert sum(int(c.split(':')[1]) for c in row['gamma_choices'].split()) == 4 // row[
        'batch_size']
  on_disk = json.loads((tmp_path / 'results' / 'tiny.json').read_text())
  assert on_disk['rows'] == record['rows']
  assert {'commit', 'date', 'machine', 'load_average', 'command'} <= set(on_disk['provenance'])
  assert 'batch_size' in (tmp_path / 'results' / 'tiny.md').read_text()
  assert (tmp_path / 'results' / 'tiny.png').stat().st_size > 1000
  # A second invocation measures anew instead of resuming the first one's records.
  records = tmp_path / 'results' / 'runs' / 'tiny_b1_t0' / 'baseline.jsonl'
  first = records.read_text()
  again = batch_sizes.run(
      gin_file=str(config), batch_sizes=[1], temperatures=[0.0], num_examples=4,
      output_dir=str(tmp_path / 'results'), name='tiny',
      extra_flags=["--gin.GAMMA='auto'", '--gin.infer.auto_gammas=(1, 2)',
                   f"--gin.infer.calibration_dir='{tmp_path / 'calibration'}'"])
  gin.clear_config()
  assert records.read_text() != first  # its records timed again
  assert again['rows'][0]['identical_outputs'] == '4/4'
