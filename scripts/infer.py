"""Decodes a task split with the baseline and with speculative decoding, side by side.

  python scripts/infer.py                                   # configs/infer/ende_local.gin
  python scripts/infer.py --gin_file=configs/infer/ende_local.gin \
      --gin.infer.num_examples=100 --gin.TEMPERATURE=1.0
  python scripts/infer.py --gin_file=configs/table2/ende_small_t0.gin \
      --gin.infer.target_checkpoint="'gs://BUCKET/xxl/checkpoint_N'" \
      --gin.infer.draft_checkpoint="'gs://BUCKET/small/checkpoint_N'"   # a paper row

T5X-style flags (--gin_file, --gin.NAME=VALUE, --gin_bindings, --gin_search_paths).
Writes <output_dir>/<decoder>.jsonl (one record per example: inputs, targets,
prediction, per-example stats), resumes after an interruption without redoing or
losing finished examples, and prints a Table-2-style summary (also written as
summary.json and summary.md).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gin
import jax
import numpy as np
import tqdm

import gin_flags  # scripts/gin_flags.py
import jaxspec.configurables  # noqa: F401  (registers the dataclasses with gin)
from jaxspec import inference, metrics
from jaxspec import partitioning as partitioning_lib
from jaxspec.config import EOS_ID, T5Config
from jaxspec.data import corpora, seqio_tasks  # seqio_tasks imports seqio lazily
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import (BigramDrafter, PromptLookupDrafter, T5Drafter,
                                       UnigramDrafter, fit_bigram, fit_unigram)
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.sampling import SamplingConfig

DEFAULT_GIN_FILE = 'configs/infer/ende_local.gin'

for _drafter in (T5Drafter, UnigramDrafter, BigramDrafter, PromptLookupDrafter):
  gin.external_configurable(_drafter, module='jaxspec')


def drafter_params(drafter, draft_checkpoint, corpus, vocab, target_length, partitioner=None):
  """The params pytree of `drafter`: a checkpoint, or n-gram tables fitted on train.

  With a partitioner, a checkpoint is read straight into the draft's shardings and
  fitted tables are placed replicated on its mesh."""
  if partitioner and not isinstance(drafter, T5Drafter):
    return partitioner.place_replicated(
        drafter_params(drafter, draft_checkpoint, corpus, vocab, target_length))
  if isinstance(drafter, T5Drafter):
    if not draft_checkpoint:
      raise ValueError('a T5 drafter needs infer.draft_checkpoint')
    if partitioner:
      return partitioner.load_params(draft_checkpoint, drafter.config, draft=True)
    return inference.load_model_params(draft_checkpoint, drafter.config)
  if isinstance(drafter, (UnigramDrafter, BigramDrafter)):
    if corpus is None:
      raise ValueError('n-gram drafters are fitted on a shipped corpus (infer.corpus); '
                       'with a seqio task other than jaxspec_*_local use a T5 drafter '
                       'or prompt lookup')
    targets = [corpora.trim_and_append_eos(vocab.encode(e['targets']), target_length)
               for e in corpora.load_split(corpus, 'train')]
    fit = fit_unigram if isinstance(drafter, UnigramDrafter) else fit_bigram
    return fit([np.asarray(t) for t in targets], drafter.vocab_size)
  return ()


class TaskData(NamedTuple):
  """A task split ready to decode."""
  name: str  # the corpus or the seqio task
  corpus: str | None  # the shipped corpus behind it, None for T5's seqio tasks
  examples: list[dict]  # {'inputs', 'targets'} texts
  input_ids: list[list[int]]  # per example, untrimmed and without EOS
  vocab: object  # .decode(ids) -> text
  metric: str  # 'bleu' or 'rouge'


def load_task(corpus, seqio_task, split, num_examples, tfds_data_dir) -> TaskData:
  """The shipped corpus's split or, when seqio_task is set, the seqio task's split."""
  if seqio_task is None:
    vocab = corpora.Vocabulary()
    examples = corpora.load_split(corpus, split)[:num_examples]
    return TaskData(corpus, corpus, examples,
                    [corpora.input_ids(e, corpus, vocab) for e in examples], vocab,
                    metrics.TASK_METRICS[corpus])
  examples = seqio_tasks.load_examples(seqio_task, split, num_examples, tfds_data_dir)
  return TaskData(seqio_task, seqio_tasks.LOCAL_TASKS.get(seqio_task),
                  [{'inputs': e['inputs'], 'targets': e['targets']} for e in examples],
                  [e['input_ids'] for e in examples], seqio_tasks.task_vocabulary(seqio_task),
                  seqio_tasks.TASK_METRICS.get(seqio_task, 'rouge'))


def encode_inputs(rows, input_length, overlong_inputs):
  """[len(rows), input_length] int32 inputs from untrimmed ids; over-long ones are cut
  with a logged warning (overlong_inputs 'truncate') or refused ('error')."""
  inputs, truncated = inference.fit_inputs(rows, input_length, overlong_inputs)
  if truncated:
    logging.warning('%d of %d inputs are longer than input_length %d and were truncated '
                    '(examples %s); set infer.overlong_inputs = "error" to refuse them',
                    len(truncated), len(rows), input_length, truncated[:10])
  return inputs


def _speculative_record_stats(stats, row: int) -> dict:
  return {'target_calls': int(stats.row_target_calls[row]),
          'batch_overlap_sum': float(stats.overlap_sum),
          'batch_verified_positions': int(stats.verified_positions),
          'batch_accepted_per_position': np.asarray(stats.accepted_per_position).tolist()}


def _run_decoder(name, decode, batches, examples, vocab, writer, progress_position):
  """Decodes the batches whose examples are not in `writer` yet, appending records."""
  pending = [b for b in batches if any(i not in writer.records for i in b)]
  if not pending:
    return
  decode(batches[0])  # Compile outside the timings.
  for indices in tqdm.tqdm(pending, desc=name, unit='batch', position=progress_position,
                           file=sys.stderr):
    output, seconds = inference.timed(decode, indices)
    result = output if name == 'baseline' else output.output
    records = []
    for row, index in enumerate(indices):
      tokens = inference.trim_at_eos(np.asarray(result.tokens[row]), EOS_ID)
      record = {'index': index, 'inputs': examples[index]['inputs'],
                'targets': examples[index]['targets'],
                'prediction': vocab.decode(tokens), 'tokens': tokens,
                'batch_start': indices[0], 'batch_seconds': seconds}
      if name == 'speculative':
        record.update(_speculative_record_stats(output.stats, row))
      records.append(record)
    writer.append(records)


def task_scores(metric, targets, predictions) -> dict:
  """{'bleu': ...} or the ROUGE scores, as T5's tasks report them."""
  if metric == 'bleu':
    return {'bleu': metrics.bleu(targets, predictions)}
  return metrics.rouge(targets, predictions)


def summarize(task, metric, draft_name, sampling, spec, writers) -> dict:
  """Table-2-style summary over the examples both decoders finished."""
  common = sorted(set.intersection(*(set(w.records) for w in writers.values())))
  summary = {'task': task, 'draft': draft_name, 'temperature': sampling.temperature,
             'gamma': spec.gamma, 'lenience': spec.lenience, 'examples': len(common)}
  seconds = {}
  for name, writer in writers.items():
    records = [writer.records[i] for i in common]
    batches = {r['batch_start']: r for r in records}
    seconds[name] = sum(r['batch_seconds'] for r in batches.values())
    summary[f'{name}_seconds'] = seconds[name]
    for score, value in task_scores(
        metric, [r['targets'] for r in records], [r['prediction'] for r in records]).items():
      summary[f'{name}_{score}'] = value
  if 'speculative' in writers:
    records = [writers['speculative'].records[i] for i in common]
    batches = {r['batch_start']: r for r in records}
    verified = sum(b['batch_verified_positions'] for b in batches.values())
    summary['alpha'] = sum(b['batch_overlap_sum'] for b in batches.values()) / max(verified, 1)
    summary['tokens_per_target_call'] = (sum(len(r['tokens']) for r in records)
                                         / max(sum(r['target_calls'] for r in records), 1))
  if len(seconds) == 2:
    summary['speedup'] = seconds['baseline'] / max(seconds['speculative'], 1e-9)
    summary['identical_outputs'] = sum(
        writers['baseline'].records[i]['tokens'] == writers['speculative'].records[i]['tokens']
        for i in common)
  return summary


def summary_markdown(summary: dict) -> str:
  keys = [k for k in summary if not isinstance(summary[k], (list, dict))]
  def fmt(value):
    return f'{value:.3f}' if isinstance(value, float) else str(value)
  return ('| ' + ' | '.join(keys) + ' |\n|' + '---|' * len(keys) + '\n| '
          + ' | '.join(fmt(summary[k]) for k in keys) + ' |\n')


@gin.configurable
def infer(*, target_model: T5Config = gin.REQUIRED, target_checkpoint: str = gin.REQUIRED,
          drafter=gin.REQUIRED, draft_name: str = gin.REQUIRED,
          output_dir: str = gin.REQUIRED, draft_checkpoint: str | None = None,
          corpus: str = 'ende', split: str = 'test', num_examples: int | None = None,
          input_length: int = 64, max_decode_length: int = 64, batch_size: int = 1,
          sampling: SamplingConfig = SamplingConfig(),
          speculative: SpeculativeConfig = SpeculativeConfig(),
          decoders: tuple[str, ...] = ('baseline', 'speculative'), seed: int = 0,
          overlong_inputs: str = 'truncate', seqio_task: str | None = None,
          tfds_data_dir: str | None = None,
          partitioning: partitioning_lib.PartitioningConfig | None = None) -> dict:
  """Runs the decoders over the split and returns the summary.

  overlong_inputs: 'truncate' (as seqio, with a logged warning counting them) or
  'error' for inputs longer than input_length.
  seqio_task: read the examples from this seqio task (e.g. T5's wmt_t2t_ende_v003,
  cnn_dailymail_v002, or jaxspec_ende_local) instead of the shipped `corpus`; needs
  `pip install 'jaxspec[data]' t5` and, for T5's tasks, the TFDS data prepared
  (in $TFDS_DATA_DIR or tfds_data_dir).
  partitioning: None decodes on the default device; a PartitioningConfig shards over
  a ('data', 'model') mesh (gin/partitioning/*.gin): parameters loaded straight into
  their shardings, batches split over 'data'; multi-host, every process runs this
  same program and only process 0 writes the outputs and the summary.
  """
  unknown = set(decoders) - {'baseline', 'speculative'}
  if unknown:
    raise ValueError(f"unknown decoders {sorted(unknown)}; use 'baseline', 'speculative'")
  # Multi-host initialization must come before anything touches a device.
  partitioner = partitioning_lib.create_partitioner(partitioning) if partitioning else None
  task = load_task(corpus, seqio_task, split, num_examples, tfds_data_dir)
  examples, vocab = task.examples, task.vocab
  inputs = encode_inputs(task.input_ids, input_length, overlong_inputs)
  target_params = (partitioner.load_params(target_checkpoint, target_model) if partitioner
                   else inference.load_model_params(target_checkpoint, target_model))
  params = (drafter_params(drafter, draft_checkpoint, task.corpus, vocab, max_decode_length,
                           partitioner) if 'speculative' in decoders else None)
  rng = jax.random.PRNGKey(seed)

  def row_keys(indices):  # A row's samples depend on its example, not its batch.
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, np.asarray(indices))

  def pad_batch(indices):
    indices = list(indices) + [indices[-1]] * (batch_size - len(indices))
    batch = inputs[indices], row_keys(indices)
    return tuple(map(partitioner.shard_batch, batch)) if partitioner else batch

  decode_fns = {
      'baseline': lambda idx: generate(
          target_params, *pad_batch(idx), config=target_model,
          max_decode_length=max_decode_length, sampling=sampling),
      'speculative': lambda idx: speculative_generate(
          target_params, params, *pad_batch(idx), target_config=target_model,
          drafter=drafter, spec=speculative, max_decode_length=max_decode_length,
          sampling=sampling),
  }
  open_writer = inference.ResumableJsonl
  if partitioner:  # Outputs gathered to every host; only process 0 writes them.
    def on_mesh(fn):
      def decode(idx):
        with partitioner.activation_sharding():  # Traced with activation constraints.
          return partitioner.to_host(fn(idx))
      return decode
    decode_fns = {name: on_mesh(fn) for name, fn in decode_fns.items()}
    open_writer = lambda path: partitioning_lib.process_zero_writer(  # noqa: E731
        inference.ResumableJsonl, path)
  batches = [list(range(i, min(i + batch_size, len(examples))))
             for i in range(0, len(examples), batch_size)]
  if partitioner is None or partitioner.is_output_process:
    os.makedirs(output_dir, exist_ok=True)
  writers = {name: open_writer(os.path.join(output_dir, f'{name}.jsonl'))
             for name in decoders}
  # Interleaved batch by batch would mix caches in memory; one decoder after the
  # other keeps each one's compiled program hot.
  for position, name in enumerate(decoders):
    _run_decoder(name, decode_fns[name], batches, examples, vocab, writers[name], position)
  if partitioner and not partitioner.is_output_process:
    return {}
  summary = summarize(task.name, task.metric, draft_name, sampling, speculative, writers)
  summary['device'] = jax.devices()[0].device_kind
  summary['batch_size'] = batch_size
  if partitioner:
    summary['mesh'] = dict(partitioner.mesh.shape)
  inference.write_text_atomic(os.path.join(output_dir, 'summary.json'),
                              json.dumps(summary, indent=2))
  inference.write_text_atomic(os.path.join(output_dir, 'summary.md'), summary_markdown(summary))
  print(summary_markdown(summary))
  return summary


def main(argv):
  if not any(a.startswith('--gin_file') for a in argv):
    argv = [f'--gin_file={DEFAULT_GIN_FILE}'] + list(argv)
  gin_flags.parse(argv)
  infer()


if __name__ == '__main__':
  main(sys.argv[1:])
