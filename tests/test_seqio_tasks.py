"""jaxspec.data.seqio_tasks: the lazy imports and their errors (always run, with
stand-in modules), and the seqio tasks over the shipped corpora against
jaxspec.data.corpora (only where seqio is installed: `pip install -e '.[test,data]'`)."""

import json
import os
import shutil
import subprocess
import sys
import types

import gin
import pytest

from jaxspec.measure import metrics
from jaxspec.data import corpora, seqio_tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_importing_the_module_imports_neither_seqio_nor_tensorflow():
  code = ('import sys, jaxspec.data.seqio_tasks; '
          "print([m for m in ('seqio', 'tensorflow', 't5') if m in sys.modules])")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       check=True, cwd=REPO)
  assert out.stdout.strip() == '[]'


def test_missing_seqio_says_what_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, 'seqio', None)  # `import seqio` raises ImportError.
  for call in (lambda: seqio_tasks.get_task('wmt_t2t_ende_v003'),
               lambda: seqio_tasks.load_examples('jaxspec_ende_local', 'test'),
               seqio_tasks.register_local_tasks):
    with pytest.raises(ImportError, match=r"pip install 'jaxspec\[data\]' t5"):
      call()


class _FakeRegistry:
  tasks = {}

  @classmethod
  def names(cls):
    return list(cls.tasks)

  @classmethod
  def get(cls, name):
    return cls.tasks[name]


def _fake_seqio(tasks):
  registry = type('TaskRegistry', (_FakeRegistry,), {'tasks': dict(tasks)})
  return types.SimpleNamespace(TaskRegistry=registry,
                               set_tfds_data_dir_override=lambda path: None)


def test_missing_t5_registry_says_what_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, 'seqio', _fake_seqio({}))
  monkeypatch.setitem(sys.modules, 't5', None)
  with pytest.raises(ImportError, match=r"`t5` package.*pip install 'jaxspec\[data\]' t5"):
    seqio_tasks.get_task('cnn_dailymail_v002')


def test_unknown_task_is_a_key_error_naming_the_known_ones(monkeypatch):
  monkeypatch.setitem(sys.modules, 'seqio', _fake_seqio({}))
  for module in ('t5', 't5.data', 't5.data.mixtures'):  # Imports, registers nothing.
    monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
  with pytest.raises(KeyError, match='jaxspec_ende_local'):
    seqio_tasks.get_task('no_such_task')


def test_unreadable_tfds_data_says_it_must_be_prepared(monkeypatch):
  vocabulary = types.SimpleNamespace(eos_id=1)

  def get_dataset(*args, **kwargs):
    raise AssertionError('Dataset wmt_t2t_translate: could not find data in /tfds')

  task = types.SimpleNamespace(
      output_features={'inputs': types.SimpleNamespace(vocabulary=vocabulary)},
      get_dataset=get_dataset)
  monkeypatch.setitem(sys.modules, 'seqio', _fake_seqio({'wmt_t2t_ende_v003': task}))
  with pytest.raises(RuntimeError, match=r'(?s)could not find data.*prepared beforehand'
                                         r'.*tfds build wmt_t2t_translate/de-en'):
    seqio_tasks.load_examples('wmt_t2t_ende_v003', 'test')


def test_python_example_drops_only_a_final_eos():
  example = {'inputs': [7, 8, 1], 'inputs_pretokenized': 'a'.encode(),
             'targets_pretokenized': 'Ü'.encode()}
  assert seqio_tasks._python_example(example, eos_id=1) == {
      'inputs': 'a', 'targets': 'Ü', 'input_ids': [7, 8]}
  example['inputs'] = [7, 8]
  assert seqio_tasks._python_example(example, eos_id=1)['input_ids'] == [7, 8]


def test_every_task_has_a_metric():
  assert set(seqio_tasks.TASK_METRICS) == set(seqio_tasks.T5_TASKS) | set(seqio_tasks.LOCAL_TASKS)
  assert set(seqio_tasks.TASK_METRICS.values()) == {'bleu', 'rouge'}
  for name, corpus in seqio_tasks.LOCAL_TASKS.items():
    assert seqio_tasks.TASK_METRICS[name] == metrics.TASK_METRICS[corpus]


# ---- With seqio installed: the local tasks for real. ----

@pytest.fixture(scope='module')
def seqio():
  import seqio  # pylint: disable=import-outside-toplevel  (the test command installs .[test,data])
  return seqio


@pytest.mark.parametrize('name,corpus', sorted(seqio_tasks.LOCAL_TASKS.items()))
def test_local_task_examples_equal_the_corpus_encoding(seqio, name, corpus):
  vocab = corpora.Vocabulary()
  expected = corpora.load_split(corpus, 'validation')[:20]
  examples = seqio_tasks.load_examples(name, 'validation', num_examples=20)
  assert name in seqio.TaskRegistry.names()
  assert [e['inputs'] for e in examples] == [
      corpora.TASK_PREFIXES[corpus] + e['inputs'] for e in expected]
  assert [e['targets'] for e in examples] == [e['targets'] for e in expected]
  assert [e['input_ids'] for e in examples] == [
      corpora.input_ids(e, corpus, vocab) for e in expected]


@pytest.mark.parametrize('name,corpus', sorted(seqio_tasks.LOCAL_TASKS.items()))
def test_local_task_trims_and_appends_eos_as_encode_example(seqio, name, corpus):
  lengths = {'inputs': 24, 'targets': 12}  # Short, so that many examples are cut.
  task = seqio_tasks.get_task(name)
  dataset = task.get_dataset(lengths, split='test', shuffle=False).take(30)
  vocab = corpora.Vocabulary()
  for actual, example in zip(dataset.as_numpy_iterator(), corpora.load_split(corpus, 'test')):
    inputs, targets = corpora.encode_example(example, corpus, vocab, 24, 12)
    assert actual['inputs'].tolist() == inputs
    assert actual['targets'].tolist() == targets


def test_local_task_vocabulary_and_metrics(seqio):
  vocab = corpora.Vocabulary()
  seqio_vocab = seqio_tasks.task_vocabulary('jaxspec_ende_local')
  text = 'Die Datei konnte nicht geöffnet werden.'
  ids = vocab.encode(text)
  assert list(seqio_vocab.encode(text)) == ids
  assert seqio_vocab.decode(ids + [1, 5, 6]) == vocab.decode(ids + [1, 5, 6]) == text
  targets, predictions = ['Die Datei ist leer.', 'Fehler'], ['Die Datei ist leer.', 'Ein Fehler']
  (bleu_fn,) = seqio_tasks.get_task('jaxspec_ende_local').metric_fns
  assert bleu_fn(targets, predictions) == {'bleu': metrics.bleu(targets, predictions)}
  (rouge_fn,) = seqio_tasks.get_task('jaxspec_docsum_local').metric_fns
  assert rouge_fn(targets, predictions) == metrics.rouge(targets, predictions)


def test_infer_reads_a_local_seqio_task_as_the_corpus(seqio, tmp_path, tiny_pair_checkpoints):
  """The launcher over jaxspec_ende_local decodes exactly what it decodes over 'ende'."""
  from jaxspec.launch import gin_flags
  from jaxspec.launch import infer as infer_script
  from jaxspec.config import T5Config  # pylint: disable=g-import-not-at-top
  # gin/models/tiny_pair.gin's models; their random checkpoints from tests/conftest.py.
  target = T5Config(vocab_size=8000, emb_dim=16, num_heads=2, head_dim=8,
                    num_encoder_layers=1, num_decoder_layers=1, mlp_dim=32)
  draft = target.replace(emb_dim=8, num_heads=1, mlp_dim=16)
  for name in ('target', 'draft'):
    shutil.copytree(tiny_pair_checkpoints / name, tmp_path / name)
  summaries = {}
  try:
    for source in ("corpus = 'ende'", "seqio_task = 'jaxspec_ende_local'"):
      gin.clear_config()
      gin_flags.parse([f'--gin_file={REPO}/gin/decoding/speculative.gin',
                       f'--gin_file={REPO}/gin/tasks/ende.gin'] + [f'--gin.{b}' for b in (
                           f'infer.{source}', 'infer.num_examples=4', 'infer.input_length=16',
                           'infer.max_decode_length=8', 'GAMMA=2', "infer.draft_name='tiny'",
                           "infer.decoders=('speculative',)",
                           f"infer.target_checkpoint='{tmp_path}/target'",
                           f"infer.draft_checkpoint='{tmp_path}/draft'",
                           f"infer.output_dir='{tmp_path}/{source[:6]}'")])
      summaries[source[:6]] = infer_script.infer(
          target_model=target, drafter=infer_script.T5Drafter(draft))
  finally:
    gin.clear_config()
  records = {}
  for name in ('corpus', 'seqio_'):
    with open(tmp_path / name / 'speculative.jsonl') as f:
      records[name] = sorted((json.loads(line) for line in f), key=lambda r: r['index'])
  assert [r['tokens'] for r in records['corpus']] == [r['tokens'] for r in records['seqio_']]
  assert [r['targets'] for r in records['corpus']] == [r['targets'] for r in records['seqio_']]
  assert summaries['seqio_']['task'] == 'jaxspec_ende_local'
  assert summaries['seqio_']['speculative_bleu'] == summaries['corpus']['speculative_bleu']
