"""The launchers end to end on tiny models: training resumes exactly, inference
resumes without redoing or losing records (also after SIGTERM or SIGKILL), samples
do not depend on the batch size, bad configuration is refused clearly and before any
model is loaded, an output directory holds one set of settings and one writer, and
users' own text is decoded from a file or stdin."""

import io
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import gin
import jax
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxspec.launch import gin_flags
from jaxspec.launch import infer as infer_script
from jaxspec.launch import train as train_script
from jaxspec import inference  # noqa: E402
from jaxspec.config import EOS_ID  # noqa: E402
from jaxspec.decoding.common import DecodeOutput  # noqa: E402
from jaxspec.checkpoints.t5x import load_t5x_checkpoint  # noqa: E402

TINY_MODEL = """
include 'gin/models/tiny_pair.gin'
MODEL = @tiny_target/jaxspec.T5Config()
"""


@pytest.fixture(autouse=True)
def _unlocked_gin():
  """Parsing locks gin's config; unlock it again so later tests can register."""
  yield
  gin.clear_config()


def _parse(tmp_path, text, bindings=()):
  gin.clear_config()
  path = tmp_path / 'config.gin'
  path.write_text(text)
  gin_flags.parse([f'--gin_file={path}'] + [f'--gin.{b}' for b in bindings])


def _train_config(checkpoint_dir):
  return TINY_MODEL + f"""
include 'gin/train_defaults.gin'
train.corpus = 'ende'
train.input_length = 16
train.target_length = 16
train.batch_size = 8
train.checkpoint_dir = '{checkpoint_dir}'
train.checkpoint_every = 2
train.eval_every = 1000
train.eval_examples = 16
train.max_train_examples = 400
train.log_every = 1000
"""


def test_training_resumes_to_the_same_parameters(tmp_path):
  """With dropout on, so a resumed run must also drop what the uninterrupted one did."""
  straight, interrupted = tmp_path / 'straight', tmp_path / 'interrupted'
  dropout = ['tiny_target/jaxspec.T5Config.dropout_rate = 0.1']
  _parse(tmp_path, _train_config(straight), ['train.num_steps=4'] + dropout)
  train_script.train()
  _parse(tmp_path, _train_config(interrupted), ['train.num_steps=2'] + dropout)
  train_script.train()
  _parse(tmp_path, _train_config(interrupted), ['train.num_steps=4'] + dropout)
  train_script.train()
  expected = load_t5x_checkpoint(str(straight / 'checkpoint_4'))
  actual = load_t5x_checkpoint(str(interrupted / 'checkpoint_4'))
  jax.tree_util.tree_map(np.testing.assert_array_equal, actual, expected)
  assert (interrupted / 'optimizer_4.msgpack').exists()
  assert (interrupted / 'config.gin').exists()


def test_distillation_refuses_a_model_with_dropout():
  with pytest.raises(ValueError, match='dropout_rate 0.1.*without dropout'):
    train_script._check_distillation_setup({}, object(), None, False, dropout_rate=0.1)


def _infer_config(tmp_path):
  config = TINY_MODEL.replace('MODEL = @tiny', 'TARGET = @tiny')
  config += """
include 'gin/tasks/ende.gin'
include 'gin/decoding/speculative.gin'
infer.target_model = @tiny_target/jaxspec.T5Config()
infer.drafter = @jaxspec.T5Drafter()
jaxspec.T5Drafter.config = @tiny_draft/jaxspec.T5Config()
infer.draft_name = 'tiny'
infer.max_decode_length = 8
infer.num_examples = 5
infer.batch_size = 2
GAMMA = 2
"""
  return config + (f"infer.target_checkpoint = '{tmp_path}/target'\n"
                   f"infer.draft_checkpoint = '{tmp_path}/draft'\n"
                   f"infer.output_dir = '{tmp_path}/out'\n")


@pytest.fixture
def tiny_checkpoints(tmp_path, tiny_pair_checkpoints):
  """tmp_path holding a copy of _infer_config's checkpoints (target/, draft/: random
  weights of gin/models/tiny_pair.gin's models, tests/conftest.py)."""
  for name in ('target', 'draft'):
    shutil.copytree(tiny_pair_checkpoints / name, tmp_path / name)
  return tmp_path


def _records(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_infer_writes_records_and_summary(tiny_checkpoints):
  tmp_path = tiny_checkpoints
  _parse(tmp_path, _infer_config(tmp_path))
  summary = infer_script.infer()
  for name in ('baseline', 'speculative'):
    records = _records(tmp_path / 'out' / f'{name}.jsonl')
    assert sorted(r['index'] for r in records) == list(range(5))
    assert all(r['targets'] and 'prediction' in r for r in records)
  assert summary['examples'] == 5 and summary['identical_outputs'] == 5
  assert summary['baseline_bleu'] == summary['speculative_bleu']
  assert 0.0 <= summary['alpha'] <= 1.0 and summary['tokens_per_target_call'] >= 1.0
  assert json.loads((tmp_path / 'out' / 'summary.json').read_text())['examples'] == 5
  # What the run decoded with (jaxspec.launch.platform_settings): the CPU's early exit.
  assert summary['platform_settings'] == {
      'platform': 'cpu', 'draft_loop': 'early_exit',
      'xla_flags': os.environ.get('XLA_FLAGS', ''), 'platform_xla_flags': []}


def test_infer_in_bfloat16_decodes_with_fixed_width_target_steps(tiny_checkpoints):
  tmp_path = tiny_checkpoints
  _parse(tmp_path, _infer_config(tmp_path),
         ["tiny_target/jaxspec.T5Config.dtype = 'bfloat16'"])
  summary = infer_script.infer()
  assert summary['examples'] == 5 and summary['identical_outputs'] == 5
  settings = json.loads((tmp_path / 'out' / 'settings.json').read_text())
  assert '"decode_positions": 3' in json.dumps(settings)  # gamma 2 + 1


@pytest.mark.parametrize('dtype, cpu_matmul, setting, decoders, num_drafts, expected', [
    ('bfloat16', 'kernel', 'auto', ('baseline', 'speculative'), 1, 4),
    ('float32', 'xla', 'auto', ('speculative',), 1, 4),
    ('float32', 'kernel', 'auto', ('baseline', 'speculative'), 1, 0),  # the kernels are exact
    ('float32', 'kernel', 'on', ('baseline', 'speculative'), 1, 4),
    ('bfloat16', 'kernel', 'off', ('baseline', 'speculative'), 1, 0),
    ('bfloat16', 'kernel', 'auto', ('baseline', 'speculative'), 2, 0),  # trees: not padded
    ('bfloat16', 'kernel', 'auto', ('baseline',), 1, 0),  # nothing verifies
    ('bfloat16', 'kernel', 'auto', ('beam', 'speculative_beam'), 1, 3),
])
def test_fixed_width_steps_where_xla_rounds_the_target(dtype, cpu_matmul, setting, decoders,
                                                       num_drafts, expected):
  from jaxspec.config import get_config  # pylint: disable=import-outside-toplevel
  from jaxspec.decoding.speculative import SpeculativeConfig  # pylint: disable=import-outside-toplevel
  from jaxspec.decoding.speculative_beam import SpeculativeBeamConfig  # pylint: disable=import-outside-toplevel
  config = get_config('test_tiny_1_1', dtype=dtype, cpu_matmul=cpu_matmul)
  result = infer_script.with_fixed_width_steps(
      config, setting, decoders, SpeculativeConfig(gamma=3, num_drafts=num_drafts),
      SpeculativeBeamConfig(gamma=2))
  assert result.decode_positions == expected
  assert result.replace(decode_positions=0) == config
  bound = config.replace(decode_positions=6)  # bound in the config: kept
  assert infer_script.with_fixed_width_steps(
      bound, setting, decoders, SpeculativeConfig(gamma=3), SpeculativeBeamConfig()) == bound
  with pytest.raises(ValueError, match="fixed_width_steps must be one of"):
    infer_script.with_fixed_width_steps(config, 'yes', decoders, SpeculativeConfig(),
                                        SpeculativeBeamConfig())


def test_infer_reports_each_stage_of_a_staged_drafter(tiny_checkpoints):
  """The int8 draft of the tiny target staged on the tiny T5 draft (its checkpoint as
  the proposer's): outputs the baseline's, each batch's stage counts in the records and
  their totals in the summary."""
  tmp_path = tiny_checkpoints
  config = _infer_config(tmp_path).replace(
      "infer.drafter = @jaxspec.T5Drafter()", "infer.drafter = @jaxspec.StagedDrafter()")
  config = config.replace(f"infer.draft_checkpoint = '{tmp_path}/draft'\n", '')
  config += f"""
jaxspec.StagedDrafter.drafter = @jaxspec.Int8Drafter()
jaxspec.Int8Drafter.config = @tiny_target/jaxspec.T5Config()
jaxspec.StagedDrafter.proposer = @jaxspec.T5Drafter()
jaxspec.StagedDrafter.lookahead = 2
jaxspec.StagedDrafter.proposer_checkpoint = '{tmp_path}/draft'
"""
  _parse(tmp_path, config)
  summary = infer_script.infer()
  assert summary['identical_outputs'] == 5
  records = _records(tmp_path / 'out' / 'speculative.jsonl')
  batches = {r['batch_start']: r['batch_stages'] for r in records}
  assert len(batches) == 3 and all(len(stages) == 1 for stages in batches.values())
  totals = summary['stages'][0]
  for key in ('rounds', 'drafter_steps', 'proposed', 'accepted'):
    assert totals[key] == sum(stages[0][key] for stages in batches.values())
  assert totals['rounds'] > 0 and 0 <= totals['accepted'] <= totals['proposed']
  assert summary['stage_acceptance'] == f"{totals['accepted'] / totals['proposed']:.3f}"


def test_stage_totals_sum_each_depth():
  batches = [{'batch_stages': [dict(rounds=2, drafter_steps=4, proposed=6, accepted=3),
                               dict(rounds=5, drafter_steps=7, proposed=4, accepted=4)]},
             {'batch_stages': [dict(rounds=1, drafter_steps=2, proposed=2, accepted=0),
                               dict(rounds=0, drafter_steps=1, proposed=0, accepted=0)]},
             {}]
  totals = infer_script.stage_totals(batches)
  assert totals == [dict(rounds=3, drafter_steps=6, proposed=8, accepted=3, acceptance=3 / 8),
                    dict(rounds=5, drafter_steps=8, proposed=4, accepted=4, acceptance=1.0)]
  assert infer_script.stage_totals([{}]) == []


def test_infer_resumes_without_redoing_or_losing_records(tiny_checkpoints):
  tmp_path = tiny_checkpoints
  _parse(tmp_path, _infer_config(tmp_path))
  infer_script.infer()
  path = tmp_path / 'out' / 'speculative.jsonl'
  complete = _records(path)
  # Simulate a kill: the last batch's records are gone and a line is torn mid-write.
  kept = [r for r in complete if r['batch_start'] != 4]
  path.write_text(''.join(json.dumps(r) + '\n' for r in kept) + '{"index": 4, "inpu')
  _parse(tmp_path, _infer_config(tmp_path))
  infer_script.infer()
  resumed = _records(path)
  assert sorted(r['index'] for r in resumed) == list(range(5))
  by_index = {r['index']: r for r in resumed}
  for record in kept:  # Finished records are kept as they were, not decoded again.
    assert by_index[record['index']] == record
  assert by_index[4]['tokens'] == {r['index']: r for r in complete}[4]['tokens']


def test_unknown_gin_binding_names_the_file_line_and_fix(tmp_path):
  path = tmp_path / 'typo.gin'
  path.write_text("include 'gin/tasks/ende.gin'\ninfer.num_exampels = 3\n")
  with pytest.raises(ValueError, match=re.escape(
      "Configurable 'infer' doesn't have a parameter named 'num_exampels'.\n"
      f'  In file "{path}", line 2\n    infer.num_exampels = 3\n'
      "  Did you mean 'num_examples'")):  # The closest name comes first.
    gin_flags.parse([f'--gin_file={path}'])
  gin.clear_config()
  with pytest.raises(ValueError, match=r"infer takes: target_model, target_checkpoint, "):
    gin_flags.parse(['--gin.infer.zzz=3'])
  gin.clear_config()
  with pytest.raises(ValueError, match=r"No configurable matching 'infr'"):
    gin_flags.parse(['--gin.infr.num_examples=3'])


def test_overlong_inputs_are_refused_or_truncated_by_config(tiny_checkpoints, caplog):
  tmp_path = tiny_checkpoints
  # The first 5 test inputs take 9, 11, 13, 15 and 14 tokens with EOS.
  _parse(tmp_path, _infer_config(tmp_path),
         ['infer.input_length=12', "infer.overlong_inputs='error'"])
  with pytest.raises(ValueError, match=r'3 of 5 inputs are longer than the input length 12 '
                     r'\(with EOS\): rows \[2, 3, 4\]'):
    infer_script.infer()
  _parse(tmp_path, _infer_config(tmp_path),
         ['infer.input_length=12', "infer.decoders=('baseline',)"])
  with caplog.at_level(logging.WARNING):
    summary = infer_script.infer()
  assert summary['examples'] == 5
  assert re.search(r'3 of 5 inputs are longer than input_length 12 and were truncated '
                   r'\(examples \[2, 3, 4\]\)', caplog.text)


def _predictions(out_dir, name):
  return {r['index']: r['tokens'] for r in _records(out_dir / f'{name}.jsonl')}


def test_sampled_predictions_do_not_depend_on_the_batch_size(tiny_checkpoints):
  tmp_path = tiny_checkpoints
  runs = {'batch1': ['infer.batch_size=1'], 'batch4': ['infer.batch_size=4'],
          'seed1': ['infer.batch_size=4', 'infer.seed=1']}
  for name, bindings in runs.items():
    _parse(tmp_path, _infer_config(tmp_path),
           bindings + ['TEMPERATURE=1.0', 'infer.num_examples=8',
                       f"infer.output_dir='{tmp_path / name}'"])
    infer_script.infer()
  for decoder in ('baseline', 'speculative'):
    batch1 = _predictions(tmp_path / 'batch1', decoder)
    assert sorted(batch1) == list(range(8))
    assert _predictions(tmp_path / 'batch4', decoder) == batch1
    # Teeth: the samples do depend on the seed.
    assert _predictions(tmp_path / 'seed1', decoder) != batch1


def test_input_length_buckets_keep_the_outputs_and_compile_each_length_once(
    tiny_checkpoints, monkeypatch):
  """Batches padded to the shortest bucket that holds them decode as the full padding
  does; each bucket's program is compiled by one warm-up decode before the timings."""
  tmp_path = tiny_checkpoints
  shapes = []
  generate = infer_script.generate
  monkeypatch.setattr(infer_script, 'generate', lambda params, tokens, *args, **kwargs: (
      shapes.append(tokens.shape), generate(params, tokens, *args, **kwargs))[1])
  runs = {'full': [], 'buckets': ['infer.input_length_buckets=(8, 12, 16)']}
  for name, bindings in runs.items():
    _parse(tmp_path, _infer_config(tmp_path),
           bindings + ['infer.num_examples=8', 'infer.batch_size=1',
                       f"infer.output_dir='{tmp_path / name}'"])
    summary = infer_script.infer()
    assert summary['identical_outputs'] == 8
  for decoder in ('baseline', 'speculative'):
    assert _predictions(tmp_path / 'buckets', decoder) == _predictions(tmp_path / 'full', decoder)
  full, bucketed = shapes[:9], shapes[9:]
  assert {shape[1] for shape in full} == {64}
  lengths = [shape[1] for shape in bucketed]
  assert set(lengths) <= {8, 12, 16, 64} and len(set(lengths)) > 1, lengths
  assert len(lengths) == 8 + len(set(lengths))  # One warm-up decode per length.
  settings = json.loads((tmp_path / 'buckets' / 'settings.json').read_text())
  assert settings['settings']['input_length_buckets'] == [8, 12, 16]


@pytest.mark.parametrize('interleave', [True, False])
def test_a_batch_is_timed_from_its_prepared_arrays_to_its_outputs(interleave, monkeypatch):
  """batch_seconds covers the decoder's call only: the batch's preparation (padding, row
  keys, device placement) runs before the clock starts; interleaved, once a batch for
  every decoder."""
  class Writer:
    def __init__(self):
      self.records = {}

    def append(self, records):
      self.records.update((r['index'], r) for r in records)

  class Vocab:
    def decode(self, tokens):
      return ' '.join(map(str, tokens))

  prepared = []

  def prepare(indices):
    prepared.append(list(indices))
    time.sleep(0.5)
    return np.array([[5, 1]] * len(indices), np.int32), None

  def decode(batch):
    time.sleep(0.05)
    tokens = jax.numpy.asarray(batch[0])
    return DecodeOutput.from_tokens(tokens, jax.numpy.zeros(tokens.shape), EOS_ID)

  # Both decoders return a DecodeOutput here: record the second's as the baseline's.
  monkeypatch.setitem(infer_script.RECORD_FIELDS, 'speculative',
                      infer_script.RECORD_FIELDS['baseline'])
  writers = {'baseline': Writer(), 'speculative': Writer()}
  infer_script._run_decoders(
      dict.fromkeys(writers, decode), prepare, [[0]], [{'inputs': 'a', 'targets': 'b'}],
      Vocab(), writers, 'f', lambda indices: (1, 2), interleave)
  # One warm-up decode per decoder, then each batch prepared once (interleaved) or once
  # for each decoder.
  assert prepared == [[0]] * (3 if interleave else 4)
  for writer in writers.values():
    record = writer.records[0]
    assert record['tokens'] == [5, 1] and record['prediction'] == '5 1'
    assert 0.05 <= record['batch_seconds'] < 0.5, record['batch_seconds']


def test_decoders_run_interleaved_batch_by_batch_or_one_after_the_other(
    tiny_checkpoints, monkeypatch):
  """infer.interleave (default True): every decoder in turn on each batch, so drift in
  the machine's speed reaches both timings alike; False: one decoder over the whole
  split, then the other. Compiling (one decode per input shape) comes first either way;
  the records are the same."""
  tmp_path = tiny_checkpoints
  calls = []
  for name, attribute in (('baseline', 'generate'), ('speculative', 'speculative_generate')):
    decode = getattr(infer_script, attribute)
    monkeypatch.setattr(infer_script, attribute, lambda *args, _decode=decode, _name=name,
                        **kwargs: (calls.append(_name), _decode(*args, **kwargs))[1])
  orders = {}
  for run, bindings in (('interleaved', []), ('sequential', ['infer.interleave=False'])):
    calls.clear()
    _parse(tmp_path, _infer_config(tmp_path),
           bindings + ['infer.num_examples=3', 'infer.batch_size=1',
                       f"infer.output_dir='{tmp_path / run}'"])
    assert infer_script.infer()['identical_outputs'] == 3
    orders[run] = list(calls)
  warm_up = ['baseline', 'speculative']  # One input shape: one compiling decode each.
  assert orders['interleaved'] == warm_up + ['baseline', 'speculative'] * 3
  assert orders['sequential'] == warm_up + ['baseline'] * 3 + ['speculative'] * 3
  for decoder in ('baseline', 'speculative'):
    assert _predictions(tmp_path / 'interleaved', decoder) == _predictions(
        tmp_path / 'sequential', decoder)
  _parse(tmp_path, _infer_config(tmp_path), ['infer.interleave=1'])
  with pytest.raises(ValueError, match='infer.interleave'):
    infer_script.infer()


# Interruption: scripts/infer.py as a subprocess, killed and started again.

INTERRUPTED_EXAMPLES = 20
DECODERS = ('baseline', 'speculative')


def _infer_command(config, out_dir):
  return [sys.executable, os.path.join(REPO, 'scripts', 'infer.py'), f'--gin_file={config}',
          f'--gin.infer.num_examples={INTERRUPTED_EXAMPLES}', '--gin.infer.max_decode_length=32',
          f"--gin.infer.output_dir='{out_dir}'"]


def _subprocess_env():
  """The suite's persistent compilation cache (tests/conftest.py), which the
  uninterrupted run in this process fills: the launcher processes load its programs."""
  return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu')


def _run_to_completion(command, env, log):
  with open(log, 'ab') as stderr:
    subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                   check=True, timeout=600)


def _run_in_this_process(command):
  """What the launcher `command` (scripts/infer.py and its flags) runs, run here."""
  gin.clear_config()
  infer_script.main(command[2:])


def _lines_on_disk(out_dir):
  paths = [os.path.join(out_dir, f'{name}.jsonl') for name in DECODERS]
  return sum(open(p, 'rb').read().count(b'\n') for p in paths if os.path.exists(p))


def _kill_after(command, env, log, out_dir, records, sig):
  """Starts the launcher and sends `sig` once `records` lines are on disk."""
  with open(log, 'ab') as stderr:
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=stderr)
    deadline = time.monotonic() + 600
    while (process.poll() is None and _lines_on_disk(out_dir) < records
           and time.monotonic() < deadline):
      time.sleep(0.002)
    process.send_signal(sig)
    process.wait(timeout=60)
  return process.returncode


def _final_records(out_dir, name):
  """The JSONL records sorted by index, without the timing field."""
  records = _records(os.path.join(out_dir, f'{name}.jsonl'))
  for record in records:
    record.pop('batch_seconds')
  return sorted(records, key=lambda r: r['index'])


def test_infer_killed_and_restarted_writes_what_an_uninterrupted_run_writes(tiny_checkpoints):
  tmp_path = tiny_checkpoints
  config = tmp_path / 'subprocess.gin'
  config.write_text(_infer_config(tmp_path))
  env, log = _subprocess_env(), tmp_path / 'stderr.log'
  # The uninterrupted run, here: it compiles the programs every launcher below loads.
  _run_in_this_process(_infer_command(config, tmp_path / 'straight'))
  seed = random.randrange(2**32)
  total = len(DECODERS) * INTERRUPTED_EXAMPLES
  # One output directory: the run is stopped by SIGTERM, the restarted run (resuming
  # what the first left) is killed by SIGKILL, and a third run completes it. Each stop
  # is at a random point with a few batches left, so it lands before the end: SIGTERM
  # in the first half, SIGKILL once the restarted run has written records of its own.
  out_dir = tmp_path / 'interrupted'
  command = _infer_command(config, out_dir)
  contexts = []
  for sig in (signal.SIGTERM, signal.SIGKILL):
    written = _lines_on_disk(out_dir)
    low, high = (1, total // 2) if sig == signal.SIGTERM else (written + 1, total - 8)
    records = random.Random(seed + sig).randrange(min(low, high - 1), high)
    returncode = _kill_after(command, env, log, out_dir, records, sig)
    contexts.append(f'{sig.name} after {records} records')
    context = f"{', then '.join(contexts)} (seed {seed}); see {log}"
    assert returncode == -sig, context
    assert _lines_on_disk(out_dir) < total, context
  _run_to_completion(command, env, log)
  for name in DECODERS:
    resumed = _final_records(out_dir, name)
    assert [r['index'] for r in resumed] == list(range(INTERRUPTED_EXAMPLES)), context
    assert resumed == _final_records(tmp_path / 'straight', name), context


# Settings: the output directory is keyed by them, locked, and checked up front.

def test_other_settings_are_refused_naming_them_or_written_beside(tiny_checkpoints):
  tmp_path = tiny_checkpoints
  _parse(tmp_path, _infer_config(tmp_path))
  first = infer_script.infer()
  out = tmp_path / 'out'
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  # The rerun: other sampling and gamma, fewer examples, the same output_dir.
  changed = ['TEMPERATURE=1.0', 'GAMMA=3', 'infer.num_examples=3']
  _parse(tmp_path, _infer_config(tmp_path), changed)
  with pytest.raises(inference.SettingsChanged,
                     match=r'sampling.temperature, speculative.gamma differ'):
    infer_script.infer()
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # Nothing touched.
  _parse(tmp_path, _infer_config(tmp_path), changed + ["infer.on_settings_change='new_dir'"])
  summary = infer_script.infer()
  fresh = json.loads(open(os.path.join(summary['output_dir'], 'settings.json')).read())
  assert summary['output_dir'] == f"{out}-{fresh['fingerprint']}"
  assert summary['temperature'] == 1.0 and summary['gamma'] == 3
  assert summary['examples'] == 3
  assert sorted(r['index'] for r in _records(os.path.join(summary['output_dir'],
                                                          'speculative.jsonl'))) == [0, 1, 2]
  # The same settings with fewer examples resume the first directory: the summary
  # covers exactly the examples asked for, from the records already there.
  _parse(tmp_path, _infer_config(tmp_path), ['infer.num_examples=3'])
  subset = infer_script.infer()
  assert subset['examples'] == 3 and first['examples'] == 5
  assert len(_records(out / 'baseline.jsonl')) == 5


def test_a_second_writer_is_refused(tiny_checkpoints):
  tmp_path = tiny_checkpoints
  _parse(tmp_path, _infer_config(tmp_path))
  os.makedirs(tmp_path / 'out')
  lock = inference.DirectoryLock(str(tmp_path / 'out'))  # A run in progress.
  try:
    with pytest.raises(inference.OutputDirectoryBusy,
                       match=rf'out is being written by another run \(pid {os.getpid()}\)'):
      infer_script.infer()
  finally:
    lock.release()
  assert not (tmp_path / 'out' / 'baseline.jsonl').exists()
  assert infer_script.infer()['examples'] == 5  # Released, the directory is free.


@pytest.mark.parametrize('binding, message', [
    ('GAMMA=2.5', r'gamma \(jaxspec.SpeculativeConfig.gamma\) must be an integer, got 2.5'),
    ('GAMMA=10000', r'gamma 10000 is larger than the decode buffer allows'),
    ('TEMPERATURE=1e999', r'temperature must be finite, got inf'),
    ('TOP_P=0.0', r'top_p must be'),
    ('TOP_K=1.5', r'top_k must be an integer'),
    ('infer.batch_size=0', r'infer.batch_size must be >= 1, got 0'),
    ('infer.num_examples=0', r'infer.num_examples must be >= 1'),
    ("infer.split='tset'", r"infer.split must be one of \('train', 'validation', 'test'\)"),
    ("infer.target_checkpoint='/nowhere'", r'no checkpoint directory at /nowhere'),
    ('infer.input_length_buckets=(16, 8)',
     r'infer.input_length_buckets must be increasing integers from 1 to the input length 64, '
     r'got \(16, 8\)'),
    ('infer.input_length_buckets=(128,)', r'infer.input_length_buckets must be increasing'),
    ('infer.batch_size=4096',
     r'decoding batches of 4096 with max_decode_length 8 and gamma 2 needs about \d+\.\d GiB '
     r'.* more than the 1.0 GiB available'),
])
def test_bad_settings_fail_before_any_model_is_loaded(tiny_checkpoints, monkeypatch,
                                                      binding, message):
  tmp_path = tiny_checkpoints
  def loaded(*args, **kwargs):
    raise AssertionError('a model was loaded before the settings were checked')
  monkeypatch.setattr(infer_script.inference, 'load_model_params', loaded)
  monkeypatch.setattr(infer_script.validation, 'available_memory_bytes', lambda _: 2**30)
  _parse(tmp_path, _infer_config(tmp_path), [binding])
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    infer_script.infer()
  assert not (tmp_path / 'out').exists()


def test_a_typo_in_a_macro_fails_naming_the_closest(tmp_path):
  with pytest.raises(ValueError, match=r"--gin.GAMA binds the macro GAMA, which no "
                     r"configuration uses .* Did you mean 'GAMMA'\?"):
    gin_flags.parse([f'--gin_file={infer_script.DEFAULT_GIN_FILE}', '--gin.GAMA=7'])
  gin.clear_config()
  gin_flags.parse([f'--gin_file={infer_script.DEFAULT_GIN_FILE}', '--gin.GAMMA=7'])


# Own text: --input_file (lines or JSON lines, a file or stdin), JSONL on stdout.

def test_own_text_from_a_file_and_stdin_equals_the_split_run(tiny_checkpoints, capsys,
                                                             monkeypatch, caplog):
  tmp_path = tiny_checkpoints
  _parse(tmp_path, _infer_config(tmp_path), ["infer.decoders=('speculative',)"])
  infer_script.infer()
  split = {r['inputs']: r['prediction'] for r in _records(tmp_path / 'out' /
                                                          'speculative.jsonl')}
  capsys.readouterr()
  texts = list(split)[:3]
  lines = [texts[0], '', texts[1], '   ', texts[2]]  # Empty lines are skipped, reported.
  text_file = tmp_path / 'mine.txt'
  text_file.write_text('\n'.join(lines) + '\n')
  argv = [f'--gin_file={tmp_path}/config.gin', "--gin.infer.decoders=('speculative',)"]
  gin.clear_config()
  with caplog.at_level(logging.WARNING):
    infer_script.main(argv + [f'--input_file={text_file}'])
  from_file = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r['line'] for r in from_file] == [1, 3, 5]
  assert [r['input'] for r in from_file] == texts
  assert [r['prediction'] for r in from_file] == [split[t] for t in texts]  # Greedy.
  assert all(r['stats']['target_calls'] >= 1 for r in from_file)
  assert re.search(r'mine.txt: 2 empty line\(s\) skipped, not decoded: lines \[2, 4\]',
                   caplog.text)
  jsonl = ''.join(json.dumps({'text': t, 'id': i}) + '\n' for i, t in enumerate(texts))
  monkeypatch.setattr(sys, 'stdin', io.TextIOWrapper(io.BytesIO(jsonl.encode())))
  gin.clear_config()
  infer_script.main(argv + ['--input_file=-', '--input_field=text'])
  from_stdin = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r['prediction'] for r in from_stdin] == [r['prediction'] for r in from_file]


@pytest.mark.parametrize('content, field, message', [
    (b'Hello\nGr\xfc\xdfe\n', None, r'bad.txt, line 2: not valid UTF-8 \(byte 0xfc at column 3\)'),
    (b'{"text": "a"}\n{"txt": "b"}\n', 'text', r"bad.txt, line 2: no field 'text' \(has \['txt'\]\)"),
    (b'{"text": "a"}\n{"text": \n', 'text', r'bad.txt, line 2: not a JSON record'),
    (b'\n  \n', None, r'bad.txt holds no input to decode \(empty lines: 2\)'),
])
def test_bad_input_files_are_named_by_file_and_line(tiny_checkpoints, content, field, message):
  tmp_path = tiny_checkpoints
  path = tmp_path / 'bad.txt'
  path.write_bytes(content)
  _parse(tmp_path, _infer_config(tmp_path))
  with pytest.raises(ValueError, match=message):
    infer_script.infer(input_file=str(path), input_field=field)


def test_infer_writes_views_of_the_first_examples(tiny_checkpoints, capsys):
  tmp_path = tiny_checkpoints
  _parse(tmp_path, _infer_config(tmp_path),
         ['infer.view_examples=2', "infer.decoders=('speculative',)"])
  infer_script.infer()
  records = {r['index']: r for r in _records(tmp_path / 'out' / 'speculative.jsonl')}
  views = tmp_path / 'out' / 'views'
  assert sorted(p.name for p in views.iterdir()) == ['example_0.html', 'example_1.html']
  for index in range(2):
    page = (views / f'example_{index}.html').read_text()
    output = re.findall(r'class="token (?:accepted|corrected|bonus)" data-token="(\d+)"', page)
    assert [int(t) for t in output] == records[index]['tokens']  # The decode it shows.
  err = capsys.readouterr().err
  assert 'example 1 (' in err and '\x1b[35;1m' in err  # Coloured: iteration 0 is a bonus.
  with pytest.raises(ValueError, match='view_examples'):
    infer_script.infer(view_examples=-1)
