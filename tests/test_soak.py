"""scripts/soak.py on tiny random models: it reports memory and compilations, passes
a steady run and fails one that compiles after its warm-up."""

import json
import os

import gin
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxspec.launch import soak

TINY = f'--gin_file={os.path.join(REPO, "configs", "soak", "tiny.gin")}'


@pytest.fixture(autouse=True)
def _unlocked_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _report(output: str) -> dict:
  return json.loads(output[output.index('{'):])


def test_steady_run_passes_and_reports(capsys):
  status = soak.main([TINY, '--gin.soak.num_examples=30', '--gin.soak.report_every=4'])
  output = capsys.readouterr().out
  report = _report(output)
  assert status == 0, output
  # Buckets 1, 4, 1, 4, ...: 12 batches for 30 examples, a report every 4th and the last.
  assert report['batches'] == 12 and report['warmup_batches'] == 4
  assert [line.split()[1] for line in output.splitlines() if line.startswith('batch ')] == [
      '4/12', '8/12', '12/12']
  assert report['compiles_in_warmup'] >= 4  # Two decoders times two buckets, at least.
  assert report['compiles_after_warmup'] == 0 and report['failures'] == []
  assert report['rss_mb_after_warmup'] > 0


def test_a_compilation_after_the_warmup_fails_the_run(capsys):
  # Bucket 3 first appears after the one warm-up batch.
  status = soak.main([TINY, '--gin.soak.num_examples=5', '--gin.soak.batch_sizes=(1, 3)',
                      '--gin.soak.warmup_batches=1'])
  captured = capsys.readouterr()
  assert status == 1
  assert _report(captured.out)['compiles_after_warmup'] >= 2
  assert 'FAILED: ' in captured.err and 'compilations after the warm-up' in captured.err


def test_a_run_shorter_than_its_warmup_is_refused():
  with pytest.raises(ValueError, match='4 batches do not outlast the 4 warm-up batches'):
    soak.main([TINY, '--gin.soak.num_examples=10'])


def test_failures_name_memory_growth_and_compilations():
  assert soak.failures(10.0, 0, max_rss_growth_mb=64.0) == []
  assert soak.failures(100.0, 3, max_rss_growth_mb=64.0) == [
      '3 compilations after the warm-up (a shape or static argument outside the buckets)',
      'RSS grew by 100.0 MB after the warm-up, more than 64.0 MB']


def test_batch_plan_cycles_buckets_and_ends_short():
  assert soak.batch_plan(7, (1, 4)) == [(1, [0]), (4, [1, 2, 3, 4]), (1, [5]), (4, [6])]
