"""The launcher as a two-process jax.distributed job on this machine (2 CPU devices per
process, a 2 x 2 ('data', 'model') mesh over the 4): every process decodes, only
process 0 writes, a resumed run skips on every process the batches process 0 has, and
the outputs are the single-device run's."""

import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, 'tests', '_multihost_worker.py')
XLA_FLAGS = ('--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true '
             '--xla_cpu_use_fusion_emitters=false')


def _env(devices: int) -> dict:
  flags = f'{XLA_FLAGS} --xla_force_host_platform_device_count={devices}'
  return dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=flags)


def _last_json(stdout: str) -> dict:
  return json.loads(stdout.strip().splitlines()[-1])


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def _tokens_by_index(path):
  return {r['index']: r['tokens'] for r in _lines(path)}


@pytest.fixture(scope='module')
def job(tmp_path_factory, tiny_launcher_run):
  scratch = tmp_path_factory.mktemp('multihost')
  # The checkpoints, and the single-device run of them: conftest.py's tiny_launcher_run
  # (made in this process, shared with tests/test_partitioning.py).
  plain = tiny_launcher_run / 'plain'
  # Process 0 resumes a run cut off after the first baseline batch (examples 0 and 1).
  os.makedirs(scratch / 'process_0')
  seeded = sorted(_lines(plain / 'baseline.jsonl'), key=lambda r: r['index'])[:2]
  with open(scratch / 'process_0' / 'baseline.jsonl', 'w') as f:
    f.writelines(json.dumps(record) + '\n' for record in seeded)
  port = str(_free_port())
  processes = [subprocess.Popen([sys.executable, WORKER, str(tiny_launcher_run), str(scratch),
                                 str(i), port],
                                env=_env(2), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in (0, 1)]
  try:
    # A process that runs a program the other does not waits for it forever.
    outputs = [p.communicate(timeout=300) for p in processes]
  finally:
    for p in processes:
      p.kill()
  for p, (_, stderr) in zip(processes, outputs):
    assert p.returncode == 0, stderr[-5000:]
  return {'scratch': scratch, 'plain_dir': plain,
          'plain': json.loads((plain / 'summary.json').read_text()),
          'processes': [_last_json(stdout) for stdout, _ in outputs], 'seeded': seeded}


def test_every_process_joins_one_mesh(job):
  for index, report in enumerate(job['processes']):
    assert (report['process_index'], report['process_count']) == (index, 2)
    assert (report['device_count'], report['local_device_count']) == (4, 2)
  assert job['processes'][0]['summary']['mesh'] == {'data': 2, 'model': 2}


def test_only_process_zero_writes(job):
  assert job['processes'][1]['summary'] == {}
  assert not os.path.exists(job['scratch'] / 'process_1')
  assert sorted(os.listdir(job['scratch'] / 'process_0')) == sorted(
      os.listdir(job['plain_dir']))


def test_outputs_equal_the_single_device_run(job):
  for decoder in ('baseline', 'speculative'):
    assert (_tokens_by_index(job['scratch'] / 'process_0' / f'{decoder}.jsonl')
            == _tokens_by_index(job['plain_dir'] / f'{decoder}.jsonl')), decoder
  summary = job['processes'][0]['summary']
  assert summary['identical_outputs'] == job['plain']['identical_outputs'] == 4


def test_the_resumed_run_keeps_what_was_written_and_adds_each_example_once(job):
  written = _lines(job['scratch'] / 'process_0' / 'baseline.jsonl')
  assert written[:2] == job['seeded']
  assert sorted(r['index'] for r in written) == [0, 1, 2, 3]
