"""Decodes a task split, or your own text, with the baseline and with speculative
decoding, side by side (batch by batch in turn, infer.interleave); or with beam search
and speculative beam search.

  python scripts/infer.py                                   # configs/infer/ende54m_int8.gin
  python scripts/infer.py --gin_file=configs/infer/ende_local.gin \
      --gin.infer.num_examples=100 --gin.TEMPERATURE=1.0
  python scripts/infer.py --input_file=my_text.txt          # one input a line
  cat docs.jsonl | python scripts/infer.py --input_file=- --input_field=text \
      --gin_file=configs/infer/docsum_local.gin             # JSON lines from stdin
  python scripts/infer.py --gin_file=configs/table2/ende_small_t0.gin \
      --gin.infer.target_checkpoint="'gs://BUCKET/xxl/checkpoint_N'" \
      --gin.infer.draft_checkpoint="'gs://BUCKET/small/checkpoint_N'"   # a paper row
  python scripts/infer.py --gin_file=configs/infer/ende54m_beam.gin \
      --gin.NUM_BEAMS=4 --gin.DRAFT_BEAMS=8       # beam and speculative beam search

T5X-style flags (--gin_file, --gin.NAME=VALUE, --gin_bindings, --gin_search_paths);
--help lists the main settings with the config's values, --list_configs the shipped
configs. Every setting is checked before anything is loaded; a user error ends the
command with one line (jaxspec.launch.command). Each --gin.NAME=VALUE that changes the
records adds _name=value to the config's output_dir (output_dir_suffix), so runs of
other settings write apart. Writes <output_dir>/<decoder>.jsonl
(one record per example: inputs, targets, prediction, per-example stats; the beam
decoders add the best beam's score and every beam's tokens and score) under an
exclusive lock, with the settings that produced them (settings.json); resumes after
an interruption without redoing or losing finished examples, refuses an output_dir
holding other settings' records (or, with on_settings_change='new_dir', writes beside
it), and prints a Table-2-style summary of exactly the examples asked for (also
written as summary.json and summary.md). With --input_file, it prints one JSON line
per input (line, input, prediction, stats) and the summary goes to stderr.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import sys
from typing import NamedTuple, Sequence


import gin
import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax.experimental import multihost_utils

from jaxspec.launch import command, gin_flags, platform_settings
import jaxspec.configurables  # noqa: F401  (registers the dataclasses and drafters with gin)
from jaxspec.measure import benchmark as measure, decode_view, metrics
from jaxspec import errors, inference, validation
from jaxspec import partitioning as partitioning_lib
from jaxspec.config import EOS_ID, T5Config
from jaxspec.data import corpora, seqio_tasks  # seqio_tasks imports seqio lazily
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.beam_search import BeamConfig, generate_beam
from jaxspec.decoding.drafters import (DraftSources, FeatureDrafter, SharedEncoderDrafter,
                                       StagedDrafter,
                                       StageStats, T5Drafter)
from jaxspec.decoding import auto_gamma
from jaxspec.decoding.speculative import (AUTO, SpeculativeConfig, check_compatible,
                                          speculative_generate)
from jaxspec.decoding.speculative_beam import SpeculativeBeamConfig, speculative_beam_generate
from jaxspec.model import abstract_params
from jaxspec.model.cpu import matmul as cpu_matmul_lib
from jaxspec.sampling import SamplingConfig

DEFAULT_GIN_FILE = 'configs/infer/ende54m_int8.gin'  # The pair on which speculation pays.
SAMPLING_DECODERS = ('baseline', 'speculative')  # Decode under `sampling`.
BEAM_DECODERS = ('beam', 'speculative_beam')  # Beam search under `beam`, deterministic.
DECODERS = SAMPLING_DECODERS + BEAM_DECODERS
DRAFTING_DECODERS = ('speculative', 'speculative_beam')  # Those that load the drafter.



def drafter_params(drafter, draft_checkpoint, corpus, vocab, target_length, partitioner=None,
                   target_params=None):
  """The params pytree of `drafter` (Drafter.load_params): a checkpoint, n-gram tables
  fitted on the corpus's train split, or (an int8 draft) the target's params quantized.

  With a partitioner, a checkpoint is read straight into the draft's shardings and
  other params are placed replicated on its mesh."""

  def train_targets():
    return [np.asarray(corpora.trim_and_append_eos(vocab.encode(e['targets']), target_length))
            for e in corpora.load_split(corpus, 'train')]

  return drafter.load_params(DraftSources(
      checkpoint=draft_checkpoint, target_params=target_params,
      train_targets=None if corpus is None else train_targets, partitioner=partitioner))


class TaskData(NamedTuple):
  """A task split (or the user's own text) ready to decode."""
  name: str  # the corpus, the seqio task, or the input file
  corpus: str | None  # the shipped corpus behind it, None for T5's seqio tasks
  examples: list[dict]  # {'inputs', 'targets'} texts (own text: 'line', no targets)
  input_ids: list[list[int]]  # per example, untrimmed and without EOS
  vocab: object  # .decode(ids) -> text
  metric: str | None  # 'bleu' or 'rouge'; None for own text (no references)
  identity: dict  # what names these examples in the run's settings


def load_task(corpus, seqio_task, split, num_examples, tfds_data_dir) -> TaskData:
  """The shipped corpus's split or, when seqio_task is set, the seqio task's split."""
  if seqio_task is None:
    vocab = corpora.Vocabulary()
    examples = corpora.load_split(corpus, split)[:num_examples]
    return TaskData(corpus, corpus, examples,
                    [corpora.input_ids(e, corpus, vocab) for e in examples], vocab,
                    metrics.TASK_METRICS[corpus], {'corpus': corpus, 'split': split})
  examples = seqio_tasks.load_examples(seqio_task, split, num_examples, tfds_data_dir)
  return TaskData(seqio_task, seqio_tasks.LOCAL_TASKS.get(seqio_task),
                  [{'inputs': e['inputs'], 'targets': e['targets']} for e in examples],
                  [e['input_ids'] for e in examples], seqio_tasks.task_vocabulary(seqio_task),
                  seqio_tasks.TASK_METRICS.get(seqio_task, 'rouge'),
                  {'seqio_task': seqio_task, 'split': split})


def load_own_text(input_file, input_field, corpus, num_examples) -> TaskData:
  """The user's inputs from a file ('-': stdin), one a line or JSON lines with
  `input_field`, with the corpus's task prefix; empty lines are reported and skipped."""
  source = 'stdin' if input_file == inference.STDIN else input_file
  data = inference.read_input_bytes(input_file)
  texts, empty = inference.read_text_inputs(data, source, input_field)
  if empty:
    logging.warning('%s: %d empty line(s) skipped, not decoded: lines %s', source,
                    len(empty), empty[:20])
  if not texts:
    raise ValueError(f'{source} holds no input to decode (empty lines: {len(empty)})')
  texts = texts[:num_examples]
  vocab = corpora.Vocabulary()
  examples = [{'inputs': t.text, 'targets': None, 'line': t.line} for t in texts]
  return TaskData(source, corpus, examples,
                  [corpora.input_ids(e, corpus, vocab) for e in examples], vocab, None,
                  {'input_file': hashlib.sha256(data).hexdigest()[:16],
                   'input_field': input_field, 'task_prefix': corpus})


def encode_inputs(rows, input_length, overlong_inputs):
  """[len(rows), input_length] int32 inputs from untrimmed ids; over-long ones are cut
  with a logged warning (overlong_inputs 'truncate') or refused ('error')."""
  inputs, truncated = inference.fit_inputs(rows, input_length, overlong_inputs)
  if truncated:
    logging.warning('%d of %d inputs are longer than input_length %d and were truncated '
                    '(examples %s); set infer.overlong_inputs = "error" to refuse them',
                    len(truncated), len(rows), input_length, truncated[:10])
  return inputs


def _sampled_fields(output, row: int) -> dict:
  """A baseline record's output: the row's tokens through EOS."""
  return {'tokens': inference.trim_at_eos(np.asarray(output.tokens[row]), EOS_ID)}


def _speculative_fields(output, row: int) -> dict:
  stats = output.stats
  return {**_sampled_fields(output.output, row),
          'target_calls': int(stats.row_target_calls[row]),
          'gamma': int(np.shape(stats.accepted_per_position)[0]),
          'batch_overlap_sum': float(stats.overlap_sum),
          'batch_verified_positions': int(stats.verified_positions),
          'batch_accepted_per_position': np.asarray(stats.accepted_per_position).tolist(),
          **_stage_fields(output.drafter_stats)}


def _stage_fields(drafter_stats) -> dict:
  """A staged drafter's per-stage counts for the batch (StageStats.summary), if any."""
  if not isinstance(drafter_stats, StageStats):
    return {}
  return {'batch_stages': drafter_stats.summary()}


def stage_totals(batches) -> list[dict]:
  """Each stage's counts summed over batch records with 'batch_stages', outermost stage
  first, with the acceptance of its proposals (accepted / proposed)."""
  totals = []
  for batch in batches:
    for depth, stage in enumerate(batch.get('batch_stages', ())):
      if depth == len(totals):
        totals.append(dict.fromkeys(('rounds', 'drafter_steps', 'proposed', 'accepted'), 0))
      for key in totals[depth]:
        totals[depth][key] += stage[key]
  for stage in totals:
    stage['acceptance'] = stage['accepted'] / max(stage['proposed'], 1)
  return totals


def _beam_fields(output, row: int) -> dict:
  """A beam record's output: the best beam (the last; T5X sorts ascending) as tokens
  and score, every beam's tokens and score (best last), and the batch's target calls:
  one per search step (the batch's rows advance in lockstep, as in T5X)."""
  beams = [inference.trim_at_eos(np.asarray(tokens), EOS_ID) for tokens in output.tokens[row]]
  scores = [float(score) for score in np.asarray(output.scores[row])]
  return {'tokens': beams[-1], 'score': scores[-1], 'beam_tokens': beams,
          'beam_scores': scores, 'batch_search_steps': int(output.steps),
          'batch_target_calls': int(output.steps)}


def _speculative_beam_fields(output, row: int) -> dict:
  """_beam_fields of the speculative output, with its batch's target and draft calls
  and how many calls advanced 0, 1, ..., gamma + 1 search steps."""
  stats = output.stats
  return {**_beam_fields(output.output, row), 'batch_target_calls': int(stats.target_calls),
          'gamma': int(np.shape(stats.steps_per_call)[0]) - 2,
          'batch_draft_calls': int(stats.draft_calls),
          'batch_calls_by_steps_advanced': np.asarray(stats.steps_per_call).tolist()}


RECORD_FIELDS = {'baseline': _sampled_fields, 'speculative': _speculative_fields,
                 'beam': _beam_fields, 'speculative_beam': _speculative_beam_fields}


def _pending(batches, writer):
  """The batches holding an example that `writer` has no record of yet."""
  return [b for b in batches if any(i not in writer.records for i in b)]


def calibration_batch_count(batch_size: int) -> int:
  """Batches gamma='auto' calibrates on: at least 3, and 48 examples."""
  return max(3, -(-48 // batch_size))


def calibration_sample(pending: Sequence, count: int) -> list:
  """`count` of the pending batches spread evenly from the first to the last: a task's
  first examples are not its typical ones (EnDe's test split opens with short interface
  strings), and a calibration on them predicted gamma 5 at batch 4 on a par with gamma 3,
  which realized ~5% more over the run."""
  if len(pending) <= count:
    return list(pending)
  return [pending[i] for i in np.linspace(0, len(pending) - 1, count).round().astype(int)]


def calibration_key(target_model, drafter, sampling, speculative, **more) -> dict:
  """What a calibration's costs depend on: the machine, the models, the decoding
  settings besides gamma, the lengths (and mesh) and, in `more`, the checkpoints (a
  retrained draft agrees otherwise, so the speedups measured for the old one are stale)."""
  return auto_gamma.calibration_key(
      target_model=inference.describe(target_model), drafter=inference.describe(drafter),
      sampling=inference.describe(sampling), speculative=inference.describe(speculative),
      **more)


def auto_gamma_decoder(decode_baseline, decode_speculative, speculative, *, batch_size,
                       gammas, key, calibration_dir, calibration_batches):
  """An AutoGammaDecoder for the run: its calibration from the cache where there is one,
  else measured on `calibration_batches` (spread over the run's batches) and cached."""
  if jax.process_count() > 1:
    raise errors.InvalidSetting(
        "gamma='auto' times decodes on each host and would choose apart; set "
        'jaxspec.SpeculativeConfig.gamma to an integer for multi-host runs')
  auto = auto_gamma.AutoGammaDecoder(
      decode_baseline, decode_speculative, speculative, batch_size=batch_size, gammas=gammas,
      key=key, cache=auto_gamma.GammaCostCache(calibration_dir))
  if auto.load_calibration():
    logging.info('gamma=auto: calibration from %s', auto.cache.path(auto.key))
  elif calibration_batches:
    print(f'gamma=auto: calibrating gammas {auto.gammas} and the baseline on '
          f'{len(calibration_batches)} batches of {batch_size}', file=sys.stderr)
    auto.calibrate(calibration_batches)
  else:  # Nothing left to decode: no decision to make.
    auto.costs = auto_gamma.BatchCosts(batch_size, 1.0, {})
  if auto.costs.call_seconds:
    speedups = auto_gamma.predicted_speedups(auto.costs, auto.alpha, auto.lengths or [1])
    costs = auto.costs
    print('gamma=auto: alpha %.3f, predicted speedups %s; ms a target call %s, a draft '
          'step %.2f, a baseline step %.2f, a batch %.2f' % (
              auto.alpha, {g: round(v, 2) for g, v in speedups.items()},
              {g: round(1e3 * v, 2) for g, v in costs.call_seconds.items()},
              1e3 * costs.draft_seconds, 1e3 * costs.step_seconds, 1e3 * costs.batch_seconds),
          file=sys.stderr)
  return auto


def auto_beam_decoder(decode_beam, decode_speculative_beam, speculative_beam,
                      calibration_batches):
  """An AutoBeamDecoder for the run, measured on `calibration_batches` (spread over the
  run's batches): plain beam search wherever no gamma is measured at least 1.05x faster."""
  auto = auto_gamma.AutoBeamDecoder(decode_beam, decode_speculative_beam, speculative_beam)
  if calibration_batches:
    print(f'speculative beam gamma=auto: measuring gammas {auto.gammas} and plain beam '
          f'search on {len(calibration_batches)} batches', file=sys.stderr)
    auto.calibrate(calibration_batches)
    print('speculative beam gamma=auto: measured speedups %s' % {
        g: round(v, 2) for g, v in auto.measured.items()}, file=sys.stderr)
  else:  # Nothing left to decode: no decision to make.
    auto.step_seconds = 1.0
  return auto


def _compile_shapes(decode, prepare, pending, input_shape):
  """Decodes one batch of each input shape among `pending`, compiling outside the timings."""
  first_of_shape = {}
  for indices in pending:
    first_of_shape.setdefault(input_shape(indices), indices)
  for indices in first_of_shape.values():
    jax.block_until_ready(decode(prepare(indices)))


def _decode_batch(name, decode, batch, indices, examples, vocab, writer, fingerprint):
  """Decodes one batch, timed, and appends its records (with the run's fingerprint).

  batch: the input arrays of `indices` as `prepare` makes them (padded to the bucket,
  the rows' keys, placed on the devices; ready before the clock starts). The timing
  covers the decoder's call, from those arrays to its outputs ready on the devices
  (gamma='auto' decides and compiles its choice for the batch before the clock starts)."""
  if isinstance(decode, (auto_gamma.AutoGammaDecoder, auto_gamma.AutoBeamDecoder)):
    decode.ready(batch)
  output, seconds = inference.timed(decode, batch)
  output = jax.device_get(output)
  records = []
  for row, index in enumerate(indices):
    fields = RECORD_FIELDS[name](output, row)
    record = {'index': index, 'inputs': examples[index]['inputs'],
              'targets': examples[index]['targets'],
              'prediction': vocab.decode(fields['tokens']), **fields,
              'batch_start': indices[0], 'batch_seconds': seconds,
              'fingerprint': fingerprint}
    if 'line' in examples[index]:
      record['line'] = examples[index]['line']
    records.append(record)
  writer.append(records)


def _run_decoders(decode_fns, prepare, batches, examples, vocab, writers, fingerprint,
                  input_shape, interleave: bool):
  """Decodes the batches each decoder in `writers` has not recorded yet.

  interleave: batch by batch, every decoder in turn on the same batch, so a change in
  the machine's speed between the start and the end of a run reaches every decoder
  alike and the walltime ratio compares like with like; else each decoder over every
  batch, one decoder after the other."""
  names = list(writers)
  pending = {name: _pending(batches, writers[name]) for name in names}
  for name in names:
    if pending[name]:
      _compile_shapes(decode_fns[name], prepare, pending[name], input_shape)
  if interleave:
    starts = {name: {b[0] for b in pending[name]} for name in names}  # batches to decode
    union = [b for b in batches if any(b[0] in starts[name] for name in names)]
    for indices in tqdm.tqdm(union, desc=' + '.join(names), unit='batch', file=sys.stderr):
      batch = jax.block_until_ready(prepare(indices))  # Once, for every decoder.
      for name in names:
        if indices[0] in starts[name]:
          _decode_batch(name, decode_fns[name], batch, indices, examples, vocab,
                        writers[name], fingerprint)
    return
  for position, name in enumerate(names):
    for indices in tqdm.tqdm(pending[name], desc=name, unit='batch', position=position,
                             file=sys.stderr):
      _decode_batch(name, decode_fns[name], jax.block_until_ready(prepare(indices)),
                    indices, examples, vocab, writers[name], fingerprint)


def task_scores(metric, targets, predictions) -> dict:
  """{'bleu': ...} or the ROUGE scores, as T5's tasks report them."""
  if metric == 'bleu':
    return {'bleu': metrics.bleu(targets, predictions)}
  return metrics.rouge(targets, predictions)


def _batch_total(records, key) -> float:
  """The sum of a per-batch field over the batches `records` come from."""
  return sum(r[key] for r in {r['batch_start']: r for r in records}.values())


def beam_comparison(beam_records, speculative_records) -> dict:
  """Speculative beam search against beam search over the same examples: target calls
  (per output token of the best beam), search steps per target call, and how many
  examples agree in every beam's tokens, and in tokens AND scores (exact float
  equality; the largest score difference is given beside)."""
  tokens = sum(len(r['tokens']) for r in beam_records)
  calls = {name: _batch_total(records, 'batch_target_calls')
           for name, records in (('beam', beam_records),
                                 ('speculative_beam', speculative_records))}
  same_tokens, same_both, difference = measure.beam_agreement(
      *[[(r['beam_tokens'], r['beam_scores']) for r in records]
        for records in (beam_records, speculative_records)])
  return {
      'beam_target_calls': calls['beam'],
      'speculative_beam_target_calls': calls['speculative_beam'],
      'beam_target_calls_per_token': calls['beam'] / max(tokens, 1),
      'speculative_beam_target_calls_per_token': calls['speculative_beam'] / max(tokens, 1),
      'search_steps_per_target_call': (_batch_total(speculative_records, 'batch_search_steps')
                                       / max(calls['speculative_beam'], 1)),
      'identical_beam_tokens': same_tokens, 'identical_beam_tokens_and_scores': same_both,
      'max_beam_score_difference': difference}


def summarize(task, metric, draft_name, sampling, spec, writers, indices, beam=None,
              speculative_beam=None, cpu_matmul: str | None = None) -> dict:
  """Table-2-style summary over `indices`, the examples asked for (a directory may
  hold more from an earlier, longer run with the same settings)."""
  common = sorted(set(indices).intersection(*(set(w.records) for w in writers.values())))
  summary = {'task': task, 'draft': draft_name}
  if cpu_matmul is not None:  # What the decode steps ran on: the kernel, or XLA and why.
    summary['matmul'] = cpu_matmul_lib.kernel_status(cpu_matmul)
  if set(writers) & set(SAMPLING_DECODERS):
    summary.update(temperature=sampling.temperature, gamma=spec.gamma,
                   lenience=spec.lenience, verification=spec.verification)
  if set(writers) & set(BEAM_DECODERS):
    summary.update(num_beams=beam.num_beams, brevity_alpha=beam.alpha,
                   draft_beams=speculative_beam.draft_width(beam.num_beams),
                   beam_gamma=speculative_beam.gamma)
  summary['examples'] = len(common)
  first = next(iter(writers.values()))  # output tokens, EOS included (tokens per second)
  summary['output_tokens'] = sum(len(first.records[i]['tokens']) for i in common)
  seconds = {}
  for name, writer in writers.items():
    records = [writer.records[i] for i in common]
    batches = {r['batch_start']: r for r in records}
    seconds[name] = sum(r['batch_seconds'] for r in batches.values())
    summary[f'{name}_seconds'] = seconds[name]
    if metric is None:  # Own text has no references to score against.
      continue
    for score, value in task_scores(
        metric, [r['targets'] for r in records], [r['prediction'] for r in records]).items():
      summary[f'{name}_{score}'] = value
  if 'speculative' in writers:
    records = [writers['speculative'].records[i] for i in common]
    batches = {r['batch_start']: r for r in records}
    verified = sum(b['batch_verified_positions'] for b in batches.values())
    summary['alpha'] = (sum(b['batch_overlap_sum'] for b in batches.values()) / verified
                        if verified else None)  # None: no drafts verified (gamma 0)
    summary['tokens_per_target_call'] = (sum(len(r['tokens']) for r in records)
                                         / max(sum(r['target_calls'] for r in records), 1))
    stages = stage_totals(batches.values())
    if stages:  # a staged drafter: each stage's calls and acceptance
      summary['stages'] = stages
      summary['stage_acceptance'] = ' / '.join(f"{s['acceptance']:.3f}" for s in stages)
    if spec.gamma == AUTO:  # how many batches ran each gamma (0: the baseline)
      chosen = [b.get('gamma') for b in batches.values()]
      summary['gamma_choices'] = ' '.join(
          f'{g}:{chosen.count(g)}' for g in sorted(set(chosen), key=lambda g: (g is None, g)))
  if 'baseline' in seconds and 'speculative' in seconds:
    summary['speedup'] = seconds['baseline'] / max(seconds['speculative'], 1e-9)
    summary['identical_outputs'] = sum(
        writers['baseline'].records[i]['tokens'] == writers['speculative'].records[i]['tokens']
        for i in common)
  if 'speculative_beam' in writers and speculative_beam.gamma == AUTO:
    chosen = [b.get('gamma') for b in {r['batch_start']: r for r in (
        writers['speculative_beam'].records[i] for i in common)}.values()]
    summary['beam_gamma_choices'] = ' '.join(
        f'{g}:{chosen.count(g)}' for g in sorted(set(chosen), key=lambda g: (g is None, g)))
  if 'beam' in seconds and 'speculative_beam' in seconds:
    summary['beam_speedup'] = seconds['beam'] / max(seconds['speculative_beam'], 1e-9)
    summary.update(beam_comparison([writers['beam'].records[i] for i in common],
                                   [writers['speculative_beam'].records[i] for i in common]))
  return summary


def summary_markdown(summary: dict) -> str:
  return inference.markdown_table(
      [summary], [k for k in summary if not isinstance(summary[k], (list, dict))])


def _beam_gamma_bound(speculative_beam: SpeculativeBeamConfig) -> int:
  """The largest gamma speculative beam search may run (with 'auto', its largest choice)."""
  if speculative_beam.gamma == AUTO:
    return max(auto_gamma.BEAM_GAMMAS)
  return speculative_beam.gamma


FIXED_WIDTH_STEPS = ('auto', 'on', 'off')


def with_fixed_width_steps(target_model: T5Config, setting: str, decoders,
                           speculative: SpeculativeConfig,
                           speculative_beam: SpeculativeBeamConfig) -> T5Config:
  """The target's config with decode_positions at its widest verify step (gamma + 1;
  speculative an integer gamma) where `setting` (infer.fixed_width_steps) asks for it."""
  if setting not in FIXED_WIDTH_STEPS:
    raise ValueError(f'infer.fixed_width_steps must be one of {FIXED_WIDTH_STEPS}, got '
                     f'{setting!r}')
  widths = ([speculative.gamma + 1] if 'speculative' in decoders else []) + (
      [_beam_gamma_bound(speculative_beam) + 1] if 'speculative_beam' in decoders else [])
  if setting == 'off' or target_model.decode_positions or not widths:
    return target_model
  if setting == 'auto' and (speculative.num_drafts > 1 or cpu_matmul_lib.exact_across_widths(
      target_model.dtype, target_model.cpu_matmul)):
    return target_model
  return target_model.replace(decode_positions=max(widths))


def check_beam_settings(*, target_model, drafter, decoders, max_decode_length, sampling,
                        beam, speculative_beam, partitioning):
  """The beam decoders' settings: w >= 1 beams, a finite alpha >= 0, a T5 draft with
  u >= w draft beams and gamma steps that fit, and no sampling settings (beam search is
  deterministic; they are refused rather than silently ignored)."""
  if not isinstance(beam, BeamConfig):
    raise TypeError(f'infer.beam must be a jaxspec.BeamConfig, got {type(beam).__name__}')
  validation.check_integer('num_beams (jaxspec.BeamConfig.num_beams)', beam.num_beams, 1)
  # should_continue's early stop bounds a live beam's best score by the largest brevity
  # penalty, which holds for alpha >= 0 only.
  validation.check_real('alpha (jaxspec.BeamConfig.alpha)', beam.alpha, 0.0)
  if sampling != SamplingConfig(temperature=0.0):
    raise ValueError(
        f'infer.decoders {tuple(decoders)} include beam search, which is deterministic: '
        f'the sampling settings {sampling} would be ignored. Leave TEMPERATURE, TOP_K and '
        'TOP_P at their defaults (0.0, 0, 1.0) for beam runs, and sample in a separate run')
  if partitioning is not None:
    raise ValueError('the beam decoders run on one device: unset infer.partitioning')
  if 'speculative_beam' not in decoders:
    return
  if not isinstance(speculative_beam, SpeculativeBeamConfig):
    raise TypeError('infer.speculative_beam must be a jaxspec.SpeculativeBeamConfig, got '
                    f'{type(speculative_beam).__name__}')
  if speculative_beam.gamma != AUTO:
    validation.check_integer('gamma (jaxspec.SpeculativeBeamConfig.gamma)',
                             speculative_beam.gamma, 1)
  validation.check_gamma(_beam_gamma_bound(speculative_beam), max_decode_length)
  validation.check_integer('draft_beams (jaxspec.SpeculativeBeamConfig.draft_beams)',
                           speculative_beam.draft_beams, 0)
  if speculative_beam.draft_width(beam.num_beams) < beam.num_beams:
    raise ValueError(
        f'draft_beams (jaxspec.SpeculativeBeamConfig.draft_beams) must be >= num_beams '
        f'({beam.num_beams}), or 0 for twice the beams, got {speculative_beam.draft_beams}')
  if not isinstance(drafter, T5Drafter):
    raise ValueError(f'speculative beam search drafts with a T5 model: infer.drafter must be '
                     f'a jaxspec.T5Drafter, got {type(drafter).__name__}')
  check_compatible(target_model, drafter)


def _checked_speculative(speculative: SpeculativeConfig, auto_gammas) -> SpeculativeConfig:
  """`speculative` as the settings checks see it: with gamma 'auto', its largest choice
  (the buffers and memory are sized for it)."""
  if speculative.gamma != AUTO:
    return speculative
  if (isinstance(auto_gammas, (str, bytes)) or not auto_gammas
      or not all(type(g) is int and g >= 1 for g in auto_gammas)):
    raise ValueError('infer.auto_gammas must be a tuple of integers >= 1 (the gammas '
                     f"gamma='auto' chooses from, besides 0), got {auto_gammas!r}")
  gamma = max(auto_gammas)
  return dataclasses.replace(speculative, gamma=gamma, verify_lengths=tuple(
      k for k in speculative.verify_lengths if k <= gamma))


def check_settings(*, target_model, drafter, decoders, batch_size, num_examples, input_length,
                   max_decode_length, sampling, speculative, seed, overlong_inputs,
                   on_settings_change, corpus, split, seqio_task, input_file, input_field,
                   beam=BeamConfig(), speculative_beam=SpeculativeBeamConfig(),
                   partitioning=None, input_length_buckets=()):
  """Every setting checked before anything is loaded, so a bad run fails in seconds
  with an error naming the setting."""
  unknown = set(decoders) - set(DECODERS)
  if unknown or not decoders or isinstance(decoders, str):
    raise ValueError(f'infer.decoders must name some of {DECODERS}, got {decoders!r}')
  validation.check_integer('infer.batch_size', batch_size, 1)
  if num_examples is not None:
    validation.check_integer('infer.num_examples', num_examples, 1)
  validation.check_integer('infer.input_length', input_length, 2)
  inference.check_length_buckets(input_length_buckets, input_length,
                                 'infer.input_length_buckets')
  validation.check_integer('infer.max_decode_length', max_decode_length, 1)
  validation.check_integer('infer.seed', seed, 0, 2**32 - 1)
  validation.check_sampling_values(sampling.temperature, sampling.top_k, sampling.top_p)
  if overlong_inputs not in inference.OVERLONG_ACTIONS:
    raise ValueError(f'infer.overlong_inputs must be one of {inference.OVERLONG_ACTIONS}, '
                     f'got {overlong_inputs!r}')
  if on_settings_change not in inference.SETTINGS_CHANGE_ACTIONS:
    raise ValueError(f'infer.on_settings_change must be one of '
                     f'{inference.SETTINGS_CHANGE_ACTIONS}, got {on_settings_change!r}')
  if seqio_task is None and corpus not in corpora.CORPORA:
    raise ValueError(f'infer.corpus must be one of {corpora.CORPORA}, got {corpus!r}')
  if seqio_task is None and input_file is None and split not in corpora.SPLITS:
    raise ValueError(f'infer.split must be one of {corpora.SPLITS}, got {split!r}')
  if input_file is not None and seqio_task is not None:
    raise ValueError('--input_file decodes your own text; unset infer.seqio_task')
  if input_field is not None and input_file is None:
    raise ValueError('--input_field names the field of JSON lines given by --input_file')
  if input_file not in (None, inference.STDIN) and not os.path.isfile(input_file):
    raise FileNotFoundError(f'--input_file {input_file} does not exist')
  if 'speculative' in decoders:
    validation.check_integer('gamma (jaxspec.SpeculativeConfig.gamma)', speculative.gamma, 1)
    validation.check_gamma(speculative.gamma, max_decode_length)
    validation.check_real('lenience (jaxspec.SpeculativeConfig.lenience)',
                          speculative.lenience, 0.0, 1.0, open_minimum=True)
    check_compatible(target_model, drafter)
  if set(decoders) & set(BEAM_DECODERS):
    check_beam_settings(target_model=target_model, drafter=drafter, decoders=decoders,
                        max_decode_length=max_decode_length, sampling=sampling, beam=beam,
                        speculative_beam=speculative_beam, partitioning=partitioning)


def _param_bytes(config: T5Config) -> int:
  leaves = jax.tree_util.tree_leaves(abstract_params(config)['params'])
  return sum(leaf.size for leaf in leaves) * np.dtype(config.param_dtype).itemsize


def _decode_memory(name, *, target_model, draft_config, batch_size, input_length,
                   max_decode_length, speculative, beam, speculative_beam) -> tuple[int, str]:
  """(estimated bytes of one decode call of decoder `name`, without parameters; what it
  decodes, for the error message)."""
  lengths = dict(input_length=input_length, max_decode_length=max_decode_length)
  described = f'batches of {batch_size} with max_decode_length {max_decode_length}'
  if name == 'baseline':
    return (validation.decode_memory_bytes(target_model, batch=batch_size, **lengths),
            f'decoding {described}')
  if name == 'speculative':
    return (validation.decode_memory_bytes(target_model, batch=batch_size,
                                           gamma=speculative.gamma, draft_config=draft_config,
                                           **lengths),
            f'decoding {described} and gamma {speculative.gamma}')
  if name == 'beam':
    return (validation.decode_memory_bytes(target_model, batch=batch_size * beam.num_beams,
                                           **lengths),
            f'beam search with {beam.num_beams} beams over {described}')
  # The target scores the draft tree's w + gamma * u rows of gamma + 1 positions.
  gamma = _beam_gamma_bound(speculative_beam)
  rows = beam.num_beams + gamma * speculative_beam.draft_width(beam.num_beams)
  return (validation.decode_memory_bytes(target_model, batch=batch_size * rows, gamma=gamma,
                                         draft_config=draft_config, **lengths),
          f'speculative beam search ({rows} tree rows per example, gamma {gamma}) over '
          f'{described}')


def check_memory(target_model, drafter, decoders, batch_size, input_length,
                 max_decode_length, speculative, partitioner, beam=BeamConfig(),
                 speculative_beam=SpeculativeBeamConfig()):
  """Refuses settings whose parameters, caches and attention scores cannot fit in the
  memory of this process's devices, before any model is loaded (the decoders run one
  after the other: the largest counts)."""
  drafting = bool(set(decoders) & set(DRAFTING_DECODERS))
  draft_config = getattr(drafter, 'config', None) if drafting else None
  if not isinstance(draft_config, T5Config):
    draft_config = None
  needed, described = max(
      _decode_memory(name, target_model=target_model, draft_config=draft_config,
                     batch_size=batch_size, input_length=input_length,
                     max_decode_length=max_decode_length, speculative=speculative, beam=beam,
                     speculative_beam=speculative_beam)
      for name in decoders)
  needed += _param_bytes(target_model) + (_param_bytes(draft_config) if draft_config else 0)
  devices = None
  if partitioner:  # The mesh spreads batch and model over its devices.
    devices = [d for d in partitioner.mesh.devices.flat
               if d.process_index == jax.process_index()]
    needed //= max(partitioner.mesh.devices.size // len(devices), 1)
  validation.check_decode_memory(needed, validation.available_memory_bytes(devices), described)


def draft_checkpoint_identity(drafter, draft_checkpoint) -> dict | None:
  """inference.checkpoint_identity of the draft checkpoint where the drafter reads one."""
  reads_checkpoint = isinstance(drafter, (T5Drafter, SharedEncoderDrafter, FeatureDrafter))
  if not (reads_checkpoint and draft_checkpoint):
    return None
  return inference.checkpoint_identity(draft_checkpoint)


def run_settings(*, target_model, target_checkpoint, drafter, draft_checkpoint, task,
                 input_length, max_decode_length, batch_size, sampling, speculative, seed,
                 overlong_inputs, decoders=SAMPLING_DECODERS, beam=BeamConfig(),
                 speculative_beam=SpeculativeBeamConfig(), input_length_buckets=(),
                 auto_gammas=None) -> dict:
  """Everything that changes the records: checkpoints (path and content), models,
  drafter, sampling, gamma, the examples, lengths, batch size (timings) and seed, and,
  for runs with a beam decoder, the beam settings (w, alpha, u, gamma). Not the
  decoders run (beyond whether a beam decoder is among them, so the sampling runs'
  fingerprints stay as they were), num_examples (a prefix of the same examples;
  records are checked against them) or the mesh."""
  return inference.describe({
      'target_model': target_model,
      'target_checkpoint': inference.checkpoint_identity(target_checkpoint),
      'drafter': drafter,
      'draft_checkpoint': draft_checkpoint_identity(drafter, draft_checkpoint),
      'examples': task.identity, 'input_length': input_length,
      'max_decode_length': max_decode_length, 'overlong_inputs': overlong_inputs,
      'batch_size': batch_size, 'sampling': sampling, 'speculative': speculative,
      'seed': seed,
      **({'input_length_buckets': tuple(input_length_buckets)} if input_length_buckets
         else {}),
      **({'beam': beam, 'speculative_beam': speculative_beam}
         if set(decoders) & set(BEAM_DECODERS) else {}),
      **({'auto_gammas': tuple(auto_gammas)} if auto_gammas else {}),
      **({'proposer_checkpoint': inference.checkpoint_identity(drafter.proposer_checkpoint)}
         if isinstance(drafter, StagedDrafter) and drafter.proposer_checkpoint else {})})


def claim_output_dir(output_dir, settings, on_settings_change, partitioner):
  """inference.claim_output_dir on the process that writes; the others learn from it
  whether to go on (multi-host), so a refusal stops every process."""
  if partitioner is None or jax.process_count() == 1:
    return inference.claim_output_dir(output_dir, settings, on_settings_change)
  claimed, error = (output_dir, None), None  # Followers write nothing.
  if partitioner.is_output_process:
    try:
      claimed = inference.claim_output_dir(output_dir, settings, on_settings_change)
    except (ValueError, RuntimeError, OSError) as caught:
      error = caught
  if int(multihost_utils.broadcast_one_to_all(np.int32(error is not None))):
    raise error or RuntimeError(f'process 0 refused output_dir {output_dir}; see its log')
  return claimed


def check_records(writers, examples, fingerprint):
  """Every stored record has this run's fingerprint and its example's input text."""
  for name, writer in writers.items():
    for index, record in writer.records.items():
      if record is None:  # A follower process's placeholder.
        continue
      if record.get('fingerprint') != fingerprint:
        raise inference.SettingsChanged(
            f'{writer.path}: record {index} was written with settings fingerprint '
            f"{record.get('fingerprint')}, not {fingerprint}")
      if index < len(examples) and record['inputs'] != examples[index]['inputs']:
        raise inference.SettingsChanged(
            f'{writer.path}: record {index} holds another input than example {index} '
            'now has; the data changed, use another output_dir')


def own_text_lines(records) -> str:
  """One JSON line per input, in file order: line, input, prediction and stats."""
  lines = []
  for record in sorted(records, key=lambda r: r['line']):
    stats = {k: v for k, v in record.items()
             if k not in ('index', 'line', 'inputs', 'targets', 'prediction', 'fingerprint')}
    lines.append(json.dumps({'line': record['line'], 'input': record['inputs'],
                             'prediction': record['prediction'], 'stats': stats},
                            ensure_ascii=False))
  return ''.join(line + '\n' for line in lines)


@gin.configurable
def infer(*, target_model: T5Config = gin.REQUIRED, target_checkpoint: str = gin.REQUIRED,
          drafter=gin.REQUIRED, draft_name: str = gin.REQUIRED,
          output_dir: str = gin.REQUIRED, draft_checkpoint: str | None = None,
          corpus: str = 'ende', split: str = 'test', num_examples: int | None = None,
          input_length: int = 64, max_decode_length: int = 64, batch_size: int = 1,
          input_length_buckets: tuple[int, ...] = (),
          sampling: SamplingConfig = SamplingConfig(),
          speculative: SpeculativeConfig = SpeculativeConfig(),
          decoders: tuple[str, ...] = SAMPLING_DECODERS, beam: BeamConfig = BeamConfig(),
          speculative_beam: SpeculativeBeamConfig = SpeculativeBeamConfig(), seed: int = 0,
          overlong_inputs: str = 'truncate', seqio_task: str | None = None,
          tfds_data_dir: str | None = None,
          partitioning: partitioning_lib.PartitioningConfig | None = None,
          on_settings_change: str = 'error', input_file: str | None = None,
          input_field: str | None = None, view_examples: int = 0,
          interleave: bool = True,
          auto_gammas: tuple[int, ...] = auto_gamma.DEFAULT_GAMMAS,
          calibration_dir: str | None = None, fixed_width_steps: str = 'auto') -> dict:
  """Runs the decoders over the split (or input_file) and returns the summary.

  overlong_inputs: 'truncate' (as seqio, with a logged warning counting them) or
  'error' for inputs longer than input_length.
  input_length_buckets: shorter lengths to pad a batch's inputs to (the shortest that
  holds its longest input; input_length when none does), so the encoder runs over
  fewer padded positions; each length compiles once, before the timings.
  seqio_task: read the examples from this seqio task (e.g. T5's wmt_t2t_ende_v003,
  cnn_dailymail_v002, or jaxspec_ende_local) instead of the shipped `corpus`; needs
  `pip install 'jaxspec[data]' t5` and, for T5's tasks, the TFDS data prepared
  (in $TFDS_DATA_DIR or tfds_data_dir).
  partitioning: None decodes on the default device; a PartitioningConfig shards over
  a ('data', 'model') mesh (gin/partitioning/*.gin): parameters loaded straight into
  their shardings, batches split over 'data'; multi-host, every process runs this
  same program and only process 0 writes the outputs and the summary.
  on_settings_change: when output_dir holds records of other settings, 'error' names
  the settings that differ; 'new_dir' writes into <output_dir>-<fingerprint> instead.
  input_file: decode your own text instead of a split: one input a line, or JSON lines
  with input_field ('-' reads stdin), with `corpus`'s task prefix; records go to
  <output_dir>/inputs-<hash of the file>/ and one JSON line per input to stdout.
  view_examples: for the first N examples, a view of the speculative decode (every
  iteration's drafts marked accepted / rejected / corrected / bonus) printed to stderr
  with colours and written as <output_dir>/views/example_<i>.html.
  decoders: some of 'baseline' and 'speculative' (decoding under `sampling` and
  `speculative`), 'beam' and 'speculative_beam' (beam search under `beam`, the draft
  proposing under `speculative_beam`; gin/decoding/beam.gin).
  interleave: True decodes batch by batch, every decoder in turn on the same batch (a
  drift in the machine's speed during the run reaches every decoder alike, so the
  walltime ratios compare like with like); False runs each decoder over the whole
  split, one after the other. Only timings depend on it, not outputs, so it is not
  part of the settings a resumed run must match.
  auto_gammas: with jaxspec.SpeculativeConfig.gamma = 'auto', the gammas calibrated
  and chosen from per batch (besides 0, the baseline: jaxspec.decoding.auto_gamma);
  calibration_dir: where calibrations are kept ($JAXSPEC_CALIBRATION_DIR, default
  ~/.cache/jaxspec/gamma_costs), so later runs of the same pair, machine and batch size
  start from them.
  fixed_width_steps: 'auto' (default) sets the target's T5Config.decode_positions to its
  widest verify step where its products go through XLA (an accelerator, bfloat16, or
  cpu_matmul='xla'), so that greedy outputs stay the baseline's token for token; the
  CPU's float32 kernels are exact without it, and a token tree (num_drafts > 1) is not
  padded. 'on' sets it wherever speculation runs, 'off' never; a decode_positions bound
  in the target's config is kept either way.
  """
  # What the user asked for is checked, read and claimed before any model loads; what
  # goes wrong there is the user's to fix (one line from the command, jaxspec.errors).
  with errors.user_input():
    checked_speculative = _checked_speculative(speculative, auto_gammas)
    check_settings(
        target_model=target_model, drafter=drafter, decoders=decoders, batch_size=batch_size,
        num_examples=num_examples, input_length=input_length,
        input_length_buckets=input_length_buckets,
        max_decode_length=max_decode_length, sampling=sampling, speculative=checked_speculative,
        seed=seed, overlong_inputs=overlong_inputs, on_settings_change=on_settings_change,
        corpus=corpus, split=split, seqio_task=seqio_task, input_file=input_file,
        input_field=input_field, beam=beam, speculative_beam=speculative_beam,
        partitioning=partitioning)
    validation.check_integer('view_examples', view_examples, 0)
    if not isinstance(interleave, bool):
      raise ValueError(f'infer.interleave must be True or False, got {interleave!r}')
  # Multi-host initialization must come before anything touches a device.
  partitioner = partitioning_lib.create_partitioner(partitioning) if partitioning else None
  with errors.user_input():
    target_model = with_fixed_width_steps(target_model, fixed_width_steps, decoders,
                                          checked_speculative, speculative_beam)
    check_memory(target_model, drafter, decoders, batch_size, input_length,
                 max_decode_length, checked_speculative, partitioner, beam, speculative_beam)
    if input_file is None:
      task = load_task(corpus, seqio_task, split, num_examples, tfds_data_dir)
    else:
      task = load_own_text(input_file, input_field, corpus, num_examples)
      output_dir = os.path.join(output_dir, f"inputs-{task.identity['input_file']}")
    inputs = encode_inputs(task.input_ids, input_length, overlong_inputs)
    settings = run_settings(
        target_model=target_model, target_checkpoint=target_checkpoint, drafter=drafter,
        draft_checkpoint=draft_checkpoint, task=task, input_length=input_length,
        input_length_buckets=input_length_buckets,
        max_decode_length=max_decode_length, batch_size=batch_size, sampling=sampling,
        speculative=speculative, seed=seed, overlong_inputs=overlong_inputs,
        decoders=decoders, beam=beam, speculative_beam=speculative_beam,
        auto_gammas=auto_gammas if speculative.gamma == AUTO else None)
    fingerprint = inference.settings_fingerprint(settings)
    output_dir, lock = claim_output_dir(output_dir, settings, on_settings_change, partitioner)
  try:
    return _decode_and_summarize(
        task=task, inputs=inputs, output_dir=output_dir, fingerprint=fingerprint,
        target_model=target_model, target_checkpoint=target_checkpoint, drafter=drafter,
        draft_name=draft_name, draft_checkpoint=draft_checkpoint,
        max_decode_length=max_decode_length, batch_size=batch_size, sampling=sampling,
        speculative=speculative, decoders=decoders, seed=seed, partitioner=partitioner,
        input_length_buckets=input_length_buckets, own_text=input_file is not None,
        view_examples=view_examples, beam=beam, speculative_beam=speculative_beam,
        interleave=interleave, auto_gammas=auto_gammas, calibration_dir=calibration_dir,
        checkpoint_identities=(settings['target_checkpoint'], settings['draft_checkpoint']))
  finally:
    if lock is not None:
      lock.release()


def _decode_and_summarize(*, task, inputs, output_dir, fingerprint, target_model,
                          target_checkpoint, drafter, draft_name, draft_checkpoint,
                          max_decode_length, batch_size, sampling, speculative, decoders,
                          seed, partitioner, own_text, input_length_buckets=(),
                          view_examples=0, beam=BeamConfig(),
                          speculative_beam=SpeculativeBeamConfig(),
                          interleave: bool = True,
                          auto_gammas: tuple[int, ...] = auto_gamma.DEFAULT_GAMMAS,
                          calibration_dir: str | None = None,
                          checkpoint_identities: tuple = ()) -> dict:
  """Loads the models, decodes what output_dir lacks and writes the summary.
  checkpoint_identities: the run settings' (target, draft) checkpoint identities, which
  key gamma='auto' calibrations too."""
  examples, vocab = task.examples, task.vocab
  target_params = (partitioner.load_params(target_checkpoint, target_model) if partitioner
                   else inference.load_model_params(target_checkpoint, target_model,
                                                   for_decoding=True))
  params = (drafter_params(drafter, draft_checkpoint, task.corpus, vocab, max_decode_length,
                           partitioner, target_params) if set(decoders) & set(DRAFTING_DECODERS) else None)
  rng = jax.random.PRNGKey(seed)

  fold_in_rows = jax.jit(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))

  def row_keys(indices):  # A row's samples depend on its example, not its batch.
    return fold_in_rows(rng, np.asarray(indices))

  def padded(indices):  # A short last batch repeats its last example.
    return list(indices) + [indices[-1]] * (batch_size - len(indices))

  def batch_tokens(indices):  # [batch_size, the bucket that holds the batch]
    return inference.trim_to_bucket(inputs[padded(indices)], input_length_buckets)

  def pad_batch(indices):  # (tokens, row keys) on the devices
    batch = batch_tokens(indices), row_keys(padded(indices))
    return tuple(map(partitioner.shard_batch, batch)) if partitioner else tuple(
        map(jnp.asarray, batch))

  def decode_speculative(batch, spec):
    return speculative_generate(
        target_params, params, *batch, target_config=target_model, drafter=drafter,
        spec=spec, max_decode_length=max_decode_length, sampling=sampling)

  decode_fns = {  # Each decodes a pad_batch.
      'baseline': lambda batch: generate(
          target_params, *batch, config=target_model,
          max_decode_length=max_decode_length, sampling=sampling),
      'speculative': lambda batch: decode_speculative(batch, speculative),
      'beam': lambda batch: generate_beam(
          target_params, batch[0], config=target_model, beam=beam,
          max_decode_length=max_decode_length),
      'speculative_beam': lambda batch: speculative_beam_generate(
          target_params, params, batch[0], target_config=target_model,
          draft_config=getattr(drafter, 'config', None), beam=beam, spec=speculative_beam,
          max_decode_length=max_decode_length),
  }
  open_writer = inference.ResumableJsonl
  decode_auto = decode_speculative  # (batch, spec) -> output, for gamma='auto'
  if partitioner:  # Outputs gathered to every host; only process 0 writes them.
    def on_mesh(fn):
      def decode(*args):
        with partitioner.activation_sharding():  # Traced with activation constraints.
          return partitioner.to_host(fn(*args))
      return decode
    decode_fns = {name: on_mesh(fn) for name, fn in decode_fns.items()}
    decode_auto = on_mesh(decode_speculative)
    open_writer = lambda path: partitioning_lib.process_zero_writer(  # noqa: E731
        inference.ResumableJsonl, path)
  batches = [list(range(i, min(i + batch_size, len(examples))))
             for i in range(0, len(examples), batch_size)]
  writers = {name: open_writer(os.path.join(output_dir, f'{name}.jsonl'))
             for name in decoders}
  check_records(writers, examples, fingerprint)
  if speculative_beam.gamma == AUTO and 'speculative_beam' in decoders:
    decode_fns['speculative_beam'] = auto_beam_decoder(
        decode_fns['beam'],
        lambda batch, spec: speculative_beam_generate(
            target_params, params, batch[0], target_config=target_model,
            draft_config=getattr(drafter, 'config', None), beam=beam, spec=spec,
            max_decode_length=max_decode_length),
        speculative_beam, [pad_batch(indices) for indices in calibration_sample(
            _pending(batches, writers['speculative_beam']), calibration_batch_count(batch_size))])
  auto = None
  if speculative.gamma == AUTO and 'speculative' in decoders:
    auto = auto_gamma_decoder(
        decode_fns['baseline'], decode_auto,
        speculative, batch_size=batch_size, gammas=auto_gammas,
        key=calibration_key(target_model, drafter, sampling, speculative,
                            input_length=inputs.shape[1], max_decode_length=max_decode_length,
                            checkpoints=checkpoint_identities,
                            mesh=dict(partitioner.mesh.shape) if partitioner else None),
        calibration_dir=calibration_dir,
        calibration_batches=[pad_batch(indices) for indices in calibration_sample(
            _pending(batches, writers['speculative']), calibration_batch_count(batch_size))])
    decode_fns['speculative'] = auto
  _run_decoders(decode_fns, pad_batch, batches, examples, vocab, writers, fingerprint,
                lambda idx: batch_tokens(idx).shape, interleave)
  if view_examples and 'speculative' in decoders:
    traced = lambda idx: speculative_generate(  # noqa: E731
        target_params, params, *pad_batch(idx), target_config=target_model,
        drafter=drafter, spec=auto.spec_for(max(auto.choose(), 1)) if auto else speculative,
        max_decode_length=max_decode_length, sampling=sampling, record_trace=True)
    write_views(traced, examples[:view_examples], vocab, output_dir,
                partitioner is None or partitioner.is_output_process)
  if partitioner and not partitioner.is_output_process:
    return {}
  summary = summarize(task.name, task.metric, draft_name, sampling, speculative, writers,
                      range(len(examples)), beam, speculative_beam, target_model.cpu_matmul)
  summary['device'] = jax.devices()[0].device_kind
  # The platform, the draft loop form and the XLA flags the run decoded with.
  summary['platform_settings'] = platform_settings.record(speculative.draft_loop)
  summary['batch_size'] = batch_size
  if partitioner:
    summary['mesh'] = dict(partitioner.mesh.shape)
  summary['output_dir'] = output_dir
  inference.write_text_atomic(os.path.join(output_dir, 'summary.json'),
                              json.dumps(summary, indent=2))
  inference.write_text_atomic(os.path.join(output_dir, 'summary.md'), summary_markdown(summary))
  if own_text:  # stdout carries the predictions; the table goes beside the logs.
    records = [writers[decoders[-1]].records[i] for i in range(len(examples))]
    sys.stdout.write(own_text_lines(records))
    sys.stdout.flush()
    print(summary_markdown(summary), file=sys.stderr)
  else:
    print(summary_markdown(summary))
  return summary


def write_views(traced_decode, examples, vocab, output_dir, write: bool = True):
  """Decodes each example alone with a trace; prints its view to stderr and writes
  <output_dir>/views/example_<i>.html (only where `write`)."""
  for index, example in enumerate(examples):
    result = jax.device_get(traced_decode([index]))
    terminal, page = decode_view.render_row(
        result.trace, 0, vocab.decode, title=f'example {index}', input_text=example['inputs'],
        eos_id=EOS_ID)
    if write:
      path = os.path.join(output_dir, 'views', f'example_{index}.html')
      inference.write_text_atomic(path, page)
      print(f'example {index} ({path}):\n{terminal}', file=sys.stderr)


def _add_input_flags(parser):
  parser.add_argument('--input_file', default=None,
                      help="decode your own text: one input a line ('-': stdin)")
  parser.add_argument('--input_field', default=None,
                      help='with --input_file: read JSON lines and decode this field')


# What --help lists, with the values of the config the command would run.
SETTINGS = (
    gin_flags.Setting('TEMPERATURE', 'sampling temperature; 0 is greedy'),
    gin_flags.Setting('TOP_K', 'sample among the k likeliest; 0: all'),
    gin_flags.Setting('TOP_P', 'sample within this top mass; 1.0: all'),
    gin_flags.Setting('GAMMA', "drafts per target call; 'auto': measured"),
    gin_flags.Setting('VERIFICATION', "'token', 'block' or 'coupled'"),
    gin_flags.Setting('LENIENCE', 'below 1.0 accepts more, changes outputs'),
    gin_flags.Setting('NUM_BEAMS', 'beams of the beam decoders'),
    gin_flags.Setting('BEAM_GAMMA', "draft steps per target call ('beam')"),
    gin_flags.Setting('infer.drafter', 'what proposes the drafts'),
    gin_flags.Setting('infer.target_checkpoint', "the target's T5X checkpoint"),
    gin_flags.Setting('infer.draft_checkpoint', "a T5 draft's checkpoint"),
    gin_flags.Setting('infer.decoders', "also 'beam', 'speculative_beam'"),
    gin_flags.Setting('infer.corpus', "the shipped task: 'ende' or 'docsum'"),
    gin_flags.Setting('infer.split', "'train', 'validation' or 'test'"),
    gin_flags.Setting('infer.num_examples', 'the first N examples (None: all)'),
    gin_flags.Setting('infer.batch_size', 'examples decoded together'),
    gin_flags.Setting('infer.max_decode_length', 'most tokens an output takes'),
    gin_flags.Setting('infer.seed', "sampling's PRNG seed"),
    gin_flags.Setting('infer.output_dir', 'records; --gin flags add a suffix'),
    gin_flags.Setting('infer.on_settings_change', "'new_dir': other settings write beside"),
)
CONFIG_DIRS = ('infer', 'table2')  # configs/<dir>/*.gin: what --list_configs lists

# infer's parameters that change no record (the examples asked for, where and how the
# run writes and times them): bound by a flag, they keep the default output directory.
RUN_ONLY_PARAMETERS = ('num_examples', 'output_dir', 'interleave', 'view_examples',
                       'on_settings_change', 'calibration_dir', 'partitioning',
                       'tfds_data_dir')
_BINDING = re.compile(r'\s*([A-Za-z_][\w./]*)\s*=\s*(.*?)\s*$')
_SUFFIX_LENGTH = 80


def output_dir_suffix(bindings: Sequence[str]) -> str:
  """What the flags' bindings (--gin.NAME=VALUE) add to the config's output_dir, so that
  runs of other settings write apart and a rerun of the same command resumes: each
  binding but those of RUN_ONLY_PARAMETERS as _name=value, sorted by name (macros in
  lower case, infer.'s parameters without it, values cut to their letters, digits and
  . + - _). '' when none is left; hashed past _SUFFIX_LENGTH characters.

  --gin.TEMPERATURE=1.0 --gin.infer.num_examples=3 -> '_temperature=1.0'.
  """
  named = {}
  for binding in bindings:
    for line in binding.splitlines():
      if match := _BINDING.match(line):
        named[match.group(1)] = match.group(2)  # Later bindings win, as in gin.
  parts = []
  for name, value in sorted(named.items()):
    parameter = name.removeprefix('infer.')
    if parameter in RUN_ONLY_PARAMETERS:
      continue
    shown = parameter.lower() if parameter.isupper() else parameter.replace('/', '.')
    words = re.findall(r'[\w.+-]+', value)  # ('speculative',) -> speculative
    parts.append(f"_{shown}={'-'.join(words) or 'none'}")
  suffix = ''.join(parts)
  if len(suffix) > _SUFFIX_LENGTH:
    digest = hashlib.sha256(suffix.encode()).hexdigest()[:8]
    suffix = f'{suffix[:_SUFFIX_LENGTH - 9]}-{digest}'
  return suffix


def flagged_output_dir(bindings: Sequence[str]) -> dict:
  """{'output_dir': the config's infer.output_dir + output_dir_suffix(bindings)} where
  the flags do not name an output_dir and change a setting; else {}."""
  if any(match.group(1) == 'infer.output_dir' for binding in bindings
         for line in binding.splitlines() if (match := _BINDING.match(line))):
    return {}
  suffix = output_dir_suffix(bindings)
  try:
    configured = gin.query_parameter('infer.output_dir')
  except ValueError:  # Unset: infer() names it.
    return {}
  if not suffix or not isinstance(configured, str):
    return {}
  return {'output_dir': configured.rstrip('/') + suffix}


def main(argv: list[str] | None = None):
  """jaxspec-infer: the flags, then infer() (configs/infer/ende54m_int8.gin by default)."""
  platform_settings.apply()  # before JAX starts its backend, which reads XLA_FLAGS once
  argv = sys.argv[1:] if argv is None else argv
  if not any(a.startswith('--gin_file') for a in argv):
    argv = [f'--gin_file={DEFAULT_GIN_FILE}'] + list(argv)
  args = gin_flags.parse(argv, description=__doc__.split('\n\n')[0],
                         add_flags=_add_input_flags, settings=SETTINGS, config_dirs=CONFIG_DIRS)
  own_text = {'input_file': args.input_file, 'input_field': args.input_field}
  infer(**{k: v for k, v in own_text.items() if v is not None},
        **flagged_output_dir(args.gin_bindings))


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())
