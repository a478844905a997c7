"""seqio tasks: T5's tasks of the paper, and tasks over the shipped corpora.

seqio pulls TensorFlow, so it is imported inside these functions only: importing
this module imports neither, and the decoding core never imports this module.

- `get_task(name)`: a registered seqio task. T5's `wmt_t2t_ende_v003` and
  `cnn_dailymail_v002` are registered by importing `t5.data.mixtures` (as T5X's
  configs do); jaxspec's
  `jaxspec_ende_local` and `jaxspec_docsum_local` by `register_local_tasks()`.
- `register_local_tasks()`: seqio tasks over the shipped corpora (splits train,
  validation, test), so T5X can train and evaluate on them. Inputs are the task
  prefix + text, tokenized with data/vocab/spm.model; EOS after trimming, as
  `corpora.encode_example`.
- `load_examples(name, split)`: a split as Python examples, for scripts/infer.py.
"""

from __future__ import annotations

import functools

from jaxspec import paths
from jaxspec.measure import metrics
from jaxspec.data import corpora

INSTALL_HINT = "pip install 'jaxspec[data]' t5"
LOCAL_TASKS = {'jaxspec_ende_local': 'ende', 'jaxspec_docsum_local': 'docsum'}
T5_TASKS = ('wmt_t2t_ende_v003', 'cnn_dailymail_v002')
# The metric scripts/infer.py reports per task ('rouge' for tasks not listed).
TASK_METRICS = {'wmt_t2t_ende_v003': 'bleu', 'cnn_dailymail_v002': 'rouge',
                'jaxspec_ende_local': 'bleu', 'jaxspec_docsum_local': 'rouge'}


def import_seqio():
  """The seqio module, or ImportError saying what to install."""
  try:
    import seqio  # pylint: disable=g-import-not-at-top
  except ImportError as error:
    raise ImportError(
        f'seqio tasks need seqio and TensorFlow, which jaxspec does not install by '
        f'default: {INSTALL_HINT}') from error
  return seqio


def _import_t5_registry(name: str):
  try:
    import t5.data.mixtures  # noqa: F401  (registers T5's tasks and mixtures)
  except ImportError as error:
    raise ImportError(
        f"seqio task {name!r} is registered by the `t5` package (t5.data.mixtures): "
        f'{INSTALL_HINT}') from error


def get_task(name: str):
  """The seqio Task `name`, registering jaxspec's or T5's tasks as needed."""
  seqio = import_seqio()
  if name in LOCAL_TASKS:
    register_local_tasks()
  elif name not in seqio.TaskRegistry.names():
    _import_t5_registry(name)
  if name not in seqio.TaskRegistry.names():
    raise KeyError(f'no seqio task {name!r}; jaxspec registers {sorted(LOCAL_TASKS)}, '
                   f'the t5 package {list(T5_TASKS)} among others')
  return seqio.TaskRegistry.get(name)


def _corpus_dataset_fn(corpus: str):
  """dataset_fn(split, shuffle_files) of seqio.FunctionDataSource over a shipped corpus."""
  def dataset_fn(split, shuffle_files, seed=None):
    del shuffle_files, seed  # One file per split, read in file order.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    examples = corpora.load_split(corpus, split)
    return tf.data.Dataset.from_tensor_slices({
        'inputs': [e['inputs'] for e in examples],
        'targets': [e['targets'] for e in examples]})
  return dataset_fn


def _prepend_prefix(dataset, prefix: str):
  """Prepends `prefix` to every example's 'inputs' text."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def prepend(example):
    return {**example, 'inputs': tf.strings.join([prefix, example['inputs']])}
  return dataset.map(prepend, num_parallel_calls=tf.data.AUTOTUNE)


def _bleu(targets, predictions):
  return {'bleu': metrics.bleu(targets, predictions)}


def local_vocabulary():
  """The shipped 8000-piece SentencePiece model as a seqio vocabulary (no extra ids)."""
  seqio = import_seqio()
  path = paths.data_file('vocab', 'spm.model')
  return seqio.SentencePieceVocabulary(str(path), extra_ids=0)


def register_local_tasks():
  """Registers `jaxspec_ende_local` and `jaxspec_docsum_local` (once per process)."""
  seqio = import_seqio()
  vocabulary = local_vocabulary()
  features = {'inputs': seqio.Feature(vocabulary, add_eos=True, required=False),
              'targets': seqio.Feature(vocabulary, add_eos=True)}
  for name, corpus in LOCAL_TASKS.items():
    if name in seqio.TaskRegistry.names():
      continue
    seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(_corpus_dataset_fn(corpus), splits=corpora.SPLITS),
        preprocessors=[
            functools.partial(_prepend_prefix, prefix=corpora.TASK_PREFIXES[corpus]),
            seqio.preprocessors.tokenize,
            seqio.CacheDatasetPlaceholder(),
            seqio.preprocessors.append_eos_after_trim,
        ],
        output_features=features,
        metric_fns=[_bleu if TASK_METRICS[name] == 'bleu' else metrics.rouge])


def _python_example(example: dict, eos_id: int) -> dict:
  ids = [int(t) for t in example['inputs']]
  if ids and ids[-1] == eos_id:
    ids = ids[:-1]
  return {'inputs': example['inputs_pretokenized'].decode('utf-8'),
          'targets': example['targets_pretokenized'].decode('utf-8'),
          'input_ids': ids}


def load_examples(name: str, split: str, num_examples: int | None = None,
                  tfds_data_dir: str | None = None) -> list[dict]:
  """The first `num_examples` (all if None) of a seqio task's split, in order.

  Each is {'inputs': the text fed to the encoder (task prefix included), 'targets',
  'input_ids': its tokens, untrimmed, without EOS}, so the caller applies its own
  input length. Raises RuntimeError saying what to prepare when the data cannot be read.
  """
  seqio = import_seqio()
  task = get_task(name)
  if tfds_data_dir:
    seqio.set_tfds_data_dir_override(tfds_data_dir)
  eos_id = task.output_features['inputs'].vocabulary.eos_id
  try:
    dataset = task.get_dataset(None, split=split, shuffle=False, num_epochs=1)
    if num_examples is not None:
      dataset = dataset.take(num_examples)
    raw = list(dataset.as_numpy_iterator())
  except Exception as error:  # TFDS and tf.data raise many kinds; keep the cause.
    raise RuntimeError(
        f'could not read split {split!r} of seqio task {name!r} '
        f'({type(error).__name__}: {error}). T5\'s tasks read TFDS datasets, which must '
        'be downloaded and prepared beforehand (e.g. `tfds build wmt_t2t_translate/de-en`, '
        '`tfds build cnn_dailymail`) into $TFDS_DATA_DIR or infer.tfds_data_dir.') from error
  return [_python_example(e, eos_id) for e in raw]


def task_vocabulary(name: str):
  """The seqio vocabulary of the task's targets (its `decode` turns ids into text)."""
  return get_task(name).output_features['targets'].vocabulary
