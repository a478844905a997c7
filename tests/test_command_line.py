"""The jaxspec-* commands as a user meets them, through their console entry points (each
launcher's `cli`, run here in-process on tiny models): a user error ends with one line
`jaxspec-<cmd>: error: <message>` on stderr and exit status 2 (its traceback only with
--verbose; a bug keeps its traceback), --help shows the main settings with the values of
the config the command would run, the shipped data and checkpoints are found from a
checkout or the error says where they were looked for, and runs of other settings write
to directories of their own while a rerun resumes."""

import importlib
import json
import os
import pathlib
import re
import sys
import tomllib

import gin
import pytest

from jaxspec import errors, inference, paths
from jaxspec.launch import command
from jaxspec.launch import infer as infer_script

REPO = pathlib.Path(__file__).resolve().parents[1]

TINY_CONFIG = """
include 'gin/tasks/ende.gin'
include 'gin/decoding/speculative.gin'
include 'gin/models/tiny_pair.gin'
infer.target_model = @tiny_target/jaxspec.T5Config()
infer.drafter = @jaxspec.T5Drafter()
jaxspec.T5Drafter.config = @tiny_draft/jaxspec.T5Config()
infer.draft_name = 'tiny'
infer.max_decode_length = 8
infer.num_examples = 3
infer.batch_size = 1
GAMMA = 2
"""


@pytest.fixture(autouse=True)
def _unlocked_gin():
  """Parsing locks gin's config; clear it so later tests can parse and register."""
  yield
  gin.clear_config()


@pytest.fixture
def tiny(tmp_path, tiny_pair_checkpoints):
  """tmp_path holding the tiny pair's checkpoints (target/, draft/) and config.gin, a
  run of them writing to out/."""
  for name in ('target', 'draft'):
    (tmp_path / name).symlink_to(tiny_pair_checkpoints / name, target_is_directory=True)
  (tmp_path / 'config.gin').write_text(
      TINY_CONFIG + f"infer.target_checkpoint = '{tmp_path}/target'\n"
      f"infer.draft_checkpoint = '{tmp_path}/draft'\n"
      f"infer.output_dir = '{tmp_path}/out'\n")
  return tmp_path


@pytest.fixture
def run(monkeypatch, capsys):
  """run(argv, module=infer, name='jaxspec-infer') -> (exit status, stdout, stderr): the
  console command `name` (module.cli) with argv, in this process."""

  def call(argv, module=infer_script, name='jaxspec-infer'):
    gin.clear_config()
    monkeypatch.setattr(sys, 'argv', [name, *argv])
    try:
      status = module.cli()
    except SystemExit as exit_:  # argparse: --help, --list_configs, its own errors.
      status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err

  return call


def _one_error_line(status, err, pattern, command_name='jaxspec-infer'):
  """The run ended with exit status 2 and its error as the last line of stderr, once,
  matching `pattern`, with no traceback."""
  lines = err.strip().splitlines()
  assert status == command.USER_ERROR_STATUS, (status, err)
  assert 'Traceback' not in err, err
  assert lines and lines[-1].startswith(f'{command_name}: error: '), err
  assert sum(line.startswith(f'{command_name}: error:') for line in lines) == 1, err
  assert re.search(pattern, lines[-1]), lines[-1]


# What the newcomer's sweep met as tracebacks: name -> (flags besides the tiny config, or a
# function of the run's directory giving them; the error line).
BAD_INPUTS = {
    'a missing input file': (lambda d: [f'--input_file={d}/nope.txt'],
                             r'--input_file \S+/nope.txt does not exist'),
    'an empty input file': (lambda d: ['--input_file=' + _file(d, 'empty.txt', b' \n')],
                            r'empty.txt holds no input to decode \(empty lines: 1\)'),
    'an input file not in UTF-8': (
        lambda d: ['--input_file=' + _file(d, 'latin1.txt', 'Grüße\n'.encode('latin-1'))],
        r'latin1.txt, line 1: not valid UTF-8 \(byte 0xfc at column 3\)'),
    'an over-long input refused': (
        ['--gin.infer.input_length=4', "--gin.infer.overlong_inputs='error'"],
        r'3 of 3 inputs are longer than the input length 4'),
    'a JSON line without the field': (
        lambda d: ['--input_file=' + _file(d, 'in.jsonl', b'{"txt": "a"}\n'),
                   '--input_field=text'],
        r"in.jsonl, line 1: no field 'text' \(has \['txt'\]\)"),
    'a misspelt macro': (['--gin.GAMA=3'], r"--gin.GAMA binds the macro GAMA.*'GAMMA'\?"),
    'gamma -1': (['--gin.GAMMA=-1'], r'gamma must be >= 1, got -1$'),
    "gamma 'fast'": (["--gin.GAMMA='fast'"], r"gamma .* must be an integer, got 'fast'"),
    'batch size 0': (['--gin.infer.batch_size=0'], r'infer.batch_size must be >= 1, got 0$'),
    'a missing checkpoint': (lambda d: [f"--gin.infer.target_checkpoint='{d}/nowhere'"],
                             r'no checkpoint directory at \S+/nowhere$'),
    'a negative temperature': (['--gin.TEMPERATURE=-1.0'],
                               r'temperature must be >= 0, got -1.0$'),
    'a missing gin file': (['--gin_file=configs/infer/nope.gin'],
                           r'--gin_file configs/infer/nope.gin: no such file .*--list_configs'),
    'a busy output directory': ('busy', r'out is being written by another run \(pid \d+\)'),
    'an output directory of other settings': (
        'other settings', r'out holds records written with other settings: .* differ'),
}


def _file(directory, name, content: bytes) -> str:
  path = os.path.join(directory, name)
  with open(path, 'wb') as f:
    f.write(content)
  return path


@pytest.mark.parametrize('case', sorted(BAD_INPUTS))
def test_a_user_error_is_one_line_and_exit_status_2(case, tiny, run, monkeypatch):
  flags, pattern = BAD_INPUTS[case]
  def loaded(*args, **kwargs):
    raise AssertionError('a model was loaded before the error was found')
  monkeypatch.setattr(infer_script.inference, 'load_model_params', loaded)
  lock = None
  if flags == 'busy':
    (tiny / 'out').mkdir()
    lock = inference.DirectoryLock(str(tiny / 'out'))
    flags = []
  elif flags == 'other settings':
    (tiny / 'out').mkdir()
    (tiny / 'out' / 'settings.json').write_text(
        json.dumps({'fingerprint': 'another', 'settings': {'seed': 7}}))
    flags = []
  elif callable(flags):
    flags = flags(tiny)
  try:
    status, _, err = run([f'--gin_file={tiny}/config.gin', *flags])
  finally:
    if lock is not None:
      lock.release()
  _one_error_line(status, err, pattern)


def test_verbose_shows_the_traceback_of_a_user_error(tiny, run):
  status, _, err = run([f'--gin_file={tiny}/config.gin', '--gin.GAMMA=-1', '--verbose'])
  assert status == command.USER_ERROR_STATUS
  assert 'Traceback' in err and 'InvalidSetting' in err, err
  assert err.strip().splitlines()[-1] == 'jaxspec-infer: error: gamma must be >= 1, got -1'


def test_a_bug_keeps_its_traceback_and_ctrl_c_is_one_line(tiny, run, monkeypatch):
  def bug(*args, **kwargs):
    raise ZeroDivisionError('a bug')
  monkeypatch.setattr(infer_script.inference, 'load_model_params', bug)
  with pytest.raises(ZeroDivisionError, match='a bug'):  # Python prints its traceback.
    run([f'--gin_file={tiny}/config.gin'])

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(infer_script.inference, 'load_model_params', interrupted)
  status, _, err = run([f'--gin_file={tiny}/config.gin'])
  assert status == command.INTERRUPTED_STATUS
  assert err.strip().splitlines()[-1] == 'jaxspec-infer: interrupted' and 'Traceback' not in err


def test_a_user_error_mid_run_keeps_the_records_written_and_a_rerun_resumes(
    tiny, run, monkeypatch):
  decode_batch = infer_script._decode_batch
  calls = []

  def fails_on_the_second_batch(name, decode, batch, indices, *args):
    calls.append(indices[0])
    if indices[0] == 1:
      raise errors.InvalidSetting('stopped by the test')
    return decode_batch(name, decode, batch, indices, *args)

  monkeypatch.setattr(infer_script, '_decode_batch', fails_on_the_second_batch)
  status, _, err = run([f'--gin_file={tiny}/config.gin'])
  _one_error_line(status, err, r'stopped by the test$')
  written = {name: (tiny / 'out' / f'{name}.jsonl').read_text()
             for name in ('baseline', 'speculative')}
  assert all([json.loads(line)['index'] for line in text.splitlines()] == [0]
             for text in written.values()), written
  monkeypatch.setattr(infer_script, '_decode_batch', decode_batch)
  status, out, err = run([f'--gin_file={tiny}/config.gin'])
  assert status == 0, err
  for name, before in written.items():
    after = (tiny / 'out' / f'{name}.jsonl').read_text()
    assert after.startswith(before)  # Kept as written, not decoded again.
    assert [json.loads(line)['index'] for line in after.splitlines()] == [0, 1, 2]
  assert json.loads((tiny / 'out' / 'summary.json').read_text())['examples'] == 3


def test_runs_of_other_settings_write_apart_and_a_rerun_resumes(tiny, run):
  """README's Quickstart: the greedy run, then the sampled one, each resumable."""
  config = f'--gin_file={tiny}/config.gin'
  assert run([config])[0] == 0
  sampled = [config, '--gin.TEMPERATURE=1.0', '--gin.infer.num_examples=2']
  status, _, err = run(sampled)
  assert status == 0, err
  directory = tiny / 'out_temperature=1.0'
  records = {path.name: path.read_bytes() for path in directory.glob('*.jsonl')}
  assert sorted(records) == ['baseline.jsonl', 'speculative.jsonl']
  settings = json.loads((directory / 'settings.json').read_text())['settings']
  assert settings['sampling']['temperature'] == 1.0
  assert json.loads((tiny / 'out' / 'settings.json').read_text())['settings'][
      'sampling']['temperature'] == 0.0
  status, _, err = run(sampled)  # The same command again: resumed, nothing redone.
  assert status == 0, err
  assert {path.name: path.read_bytes() for path in directory.glob('*.jsonl')} == records


def test_the_output_dir_suffix_names_the_flags_that_change_the_records():
  suffix = infer_script.output_dir_suffix
  assert suffix(['TEMPERATURE = 1.0']) == '_temperature=1.0'
  assert suffix(['infer.num_examples = 3', 'infer.interleave = False',
                 "infer.output_dir = 'x'", "infer.on_settings_change = 'new_dir'"]) == ''
  assert suffix(["infer.decoders = ('speculative',)", 'GAMMA = 7', 'TEMPERATURE = 0.5']) == (
      '_gamma=7_temperature=0.5_decoders=speculative')
  assert suffix(['GAMMA = 3', 'GAMMA = 5']) == '_gamma=5'  # The last binding wins.
  long = suffix([f'infer.seed = {10 ** 90}'])
  assert len(long) == infer_script._SUFFIX_LENGTH and re.fullmatch(r'_seed=1[0-9]+-\w{8}', long)


def test_help_shows_the_main_settings_of_the_config_it_would_run(tiny, run):
  status, out, _ = run(['--help'])
  assert status == 0
  for name, value in (('GAMMA', "'auto'"), ('TEMPERATURE', '0.0'),
                      ('infer.drafter', '@jaxspec.Int8Drafter()'), ('infer.batch_size', '1'),
                      ('infer.output_dir', "'results/infer/ende54m_int8'"),
                      ('infer.num_examples', 'None')):
    assert re.search(rf'^  {re.escape(name)} +{re.escape(value)} ', out, re.M), (name, out)
  assert 'configs/infer/ende54m_int8.gin' in out and '--verbose' in out
  assert f'configs/infer/ and configs/table2/ in {paths.gin_root() / "configs"}' in out
  status, out, _ = run([f'--gin_file={tiny}/config.gin', '--gin.TEMPERATURE=0.5', '-h'])
  assert status == 0
  assert re.search(r"^  GAMMA +2 ", out, re.M) and re.search(r'^  TEMPERATURE +0.5 ', out, re.M)
  assert re.search(r"^  infer.drafter +@jaxspec.T5Drafter\(\) ", out, re.M), out


def test_list_configs_names_each_shipped_config_and_what_it_runs(run):
  status, out, _ = run(['--list-configs'])
  assert status == 0
  assert re.search(r'--gin_file=configs/infer/ende54m_int8.gin +The main job: the 54M EnDe '
                   r'target with the int8 draft', out), out
  assert '--gin_file=configs/table2/ende_small_t0.gin' in out
  shipped = sorted((REPO / 'configs' / 'infer').glob('*.gin'))
  assert out.count('--gin_file=configs/infer/') == len(shipped)


def _console_commands():
  with open(REPO / 'pyproject.toml', 'rb') as f:
    return tomllib.load(f)['project']['scripts']


@pytest.mark.parametrize('name', sorted(_console_commands()))
def test_every_command_takes_help_and_verbose(name, run):
  module = importlib.import_module(_console_commands()[name].partition(':')[0])
  status, out, err = run(['--help'], module=module, name=name)
  assert status == 0, err
  assert '--verbose' in out


# The shipped data and checkpoints: a checkout's, found from it, or named in the error.

@pytest.fixture
def away_from_the_checkout(tmp_path, monkeypatch):
  """The working directory an empty tmp_path/work, the package imported from outside any
  checkout (as a wheel), and neither variable set."""
  work = tmp_path / 'work'
  work.mkdir()
  monkeypatch.chdir(work)
  monkeypatch.setattr(paths, '_PACKAGE', tmp_path / 'site-packages' / 'jaxspec')
  monkeypatch.delenv(paths.DATA_DIR_ENV, raising=False)
  monkeypatch.delenv(paths.CHECKPOINT_DIR_ENV, raising=False)
  return work


def test_the_working_directorys_checkout_then_the_variables_then_an_error(
    away_from_the_checkout, monkeypatch):
  work = away_from_the_checkout
  with pytest.raises(errors.MissingFile) as missing:
    paths.data_dir()
  message = str(missing.value)
  assert '--data_dir' in message and '$JAXSPEC_DATA_DIR' in message
  assert f'{work}/data/vocab/spm.model (the working directory)' in message
  with pytest.raises(errors.MissingFile, match=r'--checkpoint_dir or \$JAXSPEC_CHECKPOINT_DIR'):
    paths.resolve_checkpoint('checkpoints/ende54m/target')
  # A checkout: its data/ and checkpoints/ in the working directory.
  (work / 'data').symlink_to(REPO / 'data', target_is_directory=True)
  (work / 'checkpoints').symlink_to(REPO / 'checkpoints', target_is_directory=True)
  assert paths.data_dir() == work / 'data'
  assert paths.checkpoint_dir() == work / 'checkpoints'
  assert paths.resolve_checkpoint('ende54m/target') == str(work / 'checkpoints/ende54m/target')
  # The variables (what --data_dir and --checkpoint_dir set) come first.
  monkeypatch.setenv(paths.DATA_DIR_ENV, str(work / 'elsewhere'))
  assert paths.data_dir() == work / 'elsewhere'
  with pytest.raises(errors.MissingFile, match=r'elsewhere/vocab/spm.model does not exist '
                     r'\(\$JAXSPEC_DATA_DIR is \S+elsewhere\); point --data_dir'):
    paths.data_file('vocab', 'spm.model')


def test_a_command_away_from_a_checkout_says_what_to_set(tiny, away_from_the_checkout, run,
                                                        monkeypatch):
  monkeypatch.setenv(paths.DATA_DIR_ENV, '')  # Undone after the test, as --data_dir sets it.
  status, _, err = run([f'--gin_file={tiny}/config.gin'])
  _one_error_line(status, err, r'the shipped data not found: looked for \S+/work/data/vocab/'
                  r"spm.model .* point --data_dir or \$JAXSPEC_DATA_DIR at a checkout's data/")
  status, _, err = run([f'--gin_file={tiny}/config.gin', f'--data_dir={REPO / "data"}'])
  assert status == 0, err


def test_the_measurement_commands_refuse_in_one_line(tmp_path, run):
  from jaxspec.launch import cost_model, render_benchmarks
  status, _, err = run([f'--run_dir={tmp_path}'], cost_model, 'jaxspec-cost-model')
  _one_error_line(status, err, r'baseline.jsonl not found: --run_dir must hold a run',
                  'jaxspec-cost-model')
  status, _, err = run([f'--results_dir={tmp_path}/none'], render_benchmarks,
                       'jaxspec-render-benchmarks')
  _one_error_line(status, err, r'none is not a directory \(--results_dir\)',
                  'jaxspec-render-benchmarks')
