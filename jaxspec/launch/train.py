"""Trains (or distills) a T5 on a shipped corpus; gin-configured, resumable.

  python scripts/train.py --gin_file=configs/train/ende_target.gin \
      --gin.train.num_steps=2000

Writes T5X legacy checkpoints (checkpoint_<step>/) and the optimizer state
(optimizer_<step>.msgpack) into train.checkpoint_dir, plus config.gin and
train_log.jsonl (the evaluations). Started again with the same config it resumes from
the latest checkpoint, feeding the same batches (and sampled targets) an uninterrupted
run would.

With a teacher, a draft can be trained for agreement with it (jaxspec.training.distillation):
`train.divergence` selects the divergence minimized against the teacher's distribution
at every position, `train.data_mix` where each step's target sequences come from (the
references, the draft's own samples, the teacher's samples or greedy outputs), and
`train.sequence_kd` replaces the references by the teacher's greedy outputs, decoded
once and cached in `train.sequence_kd_cache_dir`. Every eval_every steps the log gets
the validation alpha: teacher forced on the teacher's own outputs for held-out inputs,
at temperatures 0 and 1 (jaxspec.measure.benchmark.measured_alpha).
"""

from __future__ import annotations

import os
import sys
import time
import json

import flax.serialization
import gin
import jax

from jaxspec import errors, paths
from jaxspec.launch import command, gin_flags
import jaxspec.configurables  # noqa: F401  (registers the dataclasses with gin)
from jaxspec.checkpoints import t5x as t5x_checkpoints
from jaxspec.config import T5Config
from jaxspec.data import corpora
from jaxspec.decoding.drafters.t5 import T5Drafter
from jaxspec.inference import pad_rows
from jaxspec.model import init_params
from jaxspec.sampling import SamplingConfig
from jaxspec.measure import benchmark
from jaxspec.training import distillation
from jaxspec.training import core as training

ALPHA_TEMPERATURES = (0.0, 1.0)


def latest_step(checkpoint_dir: str) -> int | None:
  try:
    location = t5x_checkpoints.find_t5x_checkpoint(checkpoint_dir)
  except FileNotFoundError:
    return None
  return int(os.path.basename(location.directory).split('_')[-1])


def resume(checkpoint_dir: str, params, opt_state, load_params):
  """(params, opt_state, start step) of a run: as given when checkpoint_dir holds no
  checkpoint yet, else load_params() (the latest checkpoint's tree) with the optimizer
  state saved beside it (a fresh one, said so, where none was)."""
  start = latest_step(checkpoint_dir) or 0
  if not start:
    return params, opt_state, 0
  params = jax.device_put(load_params())
  optimizer_file = os.path.join(checkpoint_dir, f'optimizer_{start}.msgpack')
  if os.path.exists(optimizer_file):
    with open(optimizer_file, 'rb') as f:
      opt_state = flax.serialization.from_bytes(opt_state, f.read())
  else:
    print(f'no optimizer state for step {start}: it restarts from scratch', flush=True)
  print(f'resuming from step {start}', flush=True)
  return params, opt_state, start


def _save(checkpoint_dir: str, params, opt_state, step: int, keep: int):
  # The optimizer state goes first: a checkpoint_<step> with no optimizer file
  # beside it can only mean a crash between the two writes, and resumes fresh.
  paths.atomic_write(os.path.join(checkpoint_dir, f'optimizer_{step}.msgpack'),
                flax.serialization.to_bytes(jax.device_get(opt_state)))
  t5x_checkpoints.save_t5x_checkpoint(checkpoint_dir, jax.device_get(params), step)
  for old in t5x_checkpoints.checkpoint_steps(checkpoint_dir)[:-keep]:
    import shutil
    shutil.rmtree(os.path.join(checkpoint_dir, f'checkpoint_{old}'), ignore_errors=True)
    optimizer_file = os.path.join(checkpoint_dir, f'optimizer_{old}.msgpack')
    if os.path.exists(optimizer_file):
      os.remove(optimizer_file)


def _evaluate(params, batches, config: T5Config):
  nll = correct = count = 0.0
  for batch in batches:
    batch_nll, batch_correct, batch_count = training.eval_step(params, batch, config=config)
    nll, correct, count = nll + batch_nll, correct + batch_correct, count + batch_count
  return float(nll / count), float(correct / count)


def _alpha_samples(teacher_params, teacher_model: T5Config, corpus: str, split: str, vocab,
                   input_length: int, max_decode_length: int, min_tokens: int, seed: int):
  """{temperature: the teacher's outputs for the held-out split's inputs}, decoded once."""
  inputs = pad_rows([corpora.encode_example(e, corpus, vocab, input_length,
                                            max_decode_length)[0]
                     for e in corpora.load_split(corpus, split)], input_length)  # [n, s]
  return {temperature: benchmark.sample_target_outputs(
      {'params': teacher_params}, teacher_model, inputs, max_decode_length,
      SamplingConfig(temperature=temperature), jax.random.PRNGKey(seed + 1), min_tokens)
          for temperature in ALPHA_TEMPERATURES}


def _validation_alpha(samples, teacher_params, teacher_model: T5Config, params,
                      model: T5Config) -> dict[float, float]:
  """{temperature: alpha of the draft `params`}, teacher forced on the teacher's outputs."""
  return {temperature: benchmark.measured_alpha(
      target_samples, {'params': teacher_params}, teacher_model, T5Drafter(model),
      {'params': params}, SamplingConfig(temperature=temperature)).alpha
          for temperature, target_samples in samples.items()}


def _append_log(checkpoint_dir: str, record: dict):
  with open(os.path.join(checkpoint_dir, 'train_log.jsonl'), 'a') as f:
    f.write(json.dumps(record) + '\n')


def _check_distillation_setup(teacher_params, divergence, data_mix, sequence_kd,
                              dropout_rate: float = 0.0):
  if divergence is not None and dropout_rate > 0:
    raise errors.InvalidSetting(
        f'the model has dropout_rate {dropout_rate}, but train.divergence steps '
        '(jaxspec.training.distillation) run it without dropout: set its dropout_rate to 0')
  if teacher_params is None and (divergence is not None or sequence_kd):
    wanted = 'train.divergence' if divergence is not None else 'train.sequence_kd'
    raise errors.InvalidSetting(f'{wanted} needs a teacher: set train.teacher_model and '
                                'train.teacher_checkpoint')
  if divergence is None and not data_mix.references_only:
    raise errors.InvalidSetting('train.data_mix decodes targets for distillation: set '
                                'train.divergence too (e.g. @jaxspec.DivergenceConfig())')


@gin.configurable
def train(*, model: T5Config = gin.REQUIRED, checkpoint_dir: str = gin.REQUIRED,
          corpus: str = 'ende', input_length: int = 64, target_length: int = 64,
          batch_size: int = 64, num_steps: int = 2000,
          optimizer: training.OptimizerConfig = training.OptimizerConfig(),
          loss: training.LossConfig = training.LossConfig(),
          teacher_model: T5Config | None = None, teacher_checkpoint: str | None = None,
          divergence: distillation.DivergenceConfig | None = None,
          data_mix: distillation.DataMixConfig = distillation.DataMixConfig(),
          sequence_kd: bool = False, sequence_kd_cache_dir: str | None = None,
          init_checkpoint: str | None = None,
          checkpoint_every: int = 250, keep_checkpoints: int = 2, eval_every: int = 250,
          eval_examples: int = 512, alpha_tokens: int = 2000, alpha_split: str = 'validation',
          log_every: int = 25, seed: int = 0, max_train_examples: int | None = None,
          length_quantum: int = training.LENGTH_QUANTUM):
  """Trains `model` on `corpus` for num_steps; distills when a teacher is given.

  divergence: train on it against the teacher's distribution at every position of
    each step's targets (jaxspec.training.distillation), instead of `loss`.
  data_mix: where each step's targets come from (needs a divergence unless references).
  sequence_kd: the references are the teacher's greedy outputs for the training inputs.
  init_checkpoint: a fresh run starts from these params (e.g. a distilled draft).
  alpha_tokens: with a teacher, the validation alpha at temperatures 0 and 1 is logged
    every eval_every steps over about this many of the teacher's output tokens for
    alpha_split's inputs (0: never).
  length_quantum: batches (training, evaluation, decoded targets) are padded to its
    length buckets (jaxspec.training.core.length_bucket); on an accelerator input_length.
  """
  os.makedirs(checkpoint_dir, exist_ok=True)
  with open(os.path.join(checkpoint_dir, 'config.gin'), 'w') as f:
    f.write(gin.operative_config_str())
  vocab = corpora.Vocabulary()
  if vocab.vocab_size > model.vocab_size:
    raise errors.InvalidSetting(f'the vocabulary has {vocab.vocab_size} pieces but the model only '
                                f'{model.vocab_size} embeddings')
  if alpha_split == 'train':
    raise errors.InvalidSetting(
        "alpha_split must be held out ('validation' or 'test'), not 'train'")

  teacher_params = None
  if teacher_checkpoint:
    teacher_params = jax.device_put(t5x_checkpoints.load_t5x_checkpoint(
        teacher_checkpoint, teacher_model, dtype=teacher_model.param_dtype))
  _check_distillation_setup(teacher_params, divergence, data_mix, sequence_kd,
                            model.dropout_rate)

  train_pairs = corpora.encoded_split(corpus, 'train', vocab, input_length, target_length,
                                      max_train_examples)
  if sequence_kd:
    train_pairs = distillation.sequence_kd_pairs(train_pairs, teacher_params, teacher_model,
                                                 target_length, sequence_kd_cache_dir,
                                                 batch_size, length_quantum)
  eval_batches = training.epoch_batches(
      corpora.encoded_split(corpus, 'validation', vocab, input_length, target_length,
                            eval_examples),
      batch_size, seed, 0, length_quantum)
  alpha_samples = None
  if teacher_params is not None and alpha_tokens > 0:
    alpha_samples = _alpha_samples(teacher_params, teacher_model, corpus, alpha_split, vocab,
                                   input_length, target_length, alpha_tokens, seed)
  tx = training.make_optimizer(optimizer, num_steps)

  params = init_params(model, jax.random.PRNGKey(seed))['params']
  params, opt_state, start = resume(
      checkpoint_dir, params, tx.init(params),
      lambda: t5x_checkpoints.load_t5x_checkpoint(checkpoint_dir, model,
                                                  dtype=model.param_dtype))
  if not start and init_checkpoint:
    params = jax.device_put(t5x_checkpoints.load_t5x_checkpoint(
        init_checkpoint, model, dtype=model.param_dtype))
    print(f'initialized from {init_checkpoint}', flush=True)
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  print(f'{n_params / 1e6:.2f}M parameters, {len(train_pairs)} training examples, '
        f'steps {start}..{num_steps}', flush=True)

  def evaluate(done: int):
    nll, accuracy = _evaluate(params, eval_batches, model)
    record = {'step': done, 'validation_xent': nll, 'validation_token_accuracy': accuracy}
    line = f'step {done} validation xent {nll:.4f} token accuracy {accuracy:.4f}'
    if alpha_samples is not None:
      alphas = _validation_alpha(alpha_samples, teacher_params, teacher_model, params, model)
      record.update({f'validation_alpha_t{t:g}': a for t, a in alphas.items()})
      line += ' ' + ' '.join(f'alpha T={t:g} {a:.4f}' for t, a in alphas.items())
    print(line, flush=True)
    _append_log(checkpoint_dir, record)

  # The teacher's logits are computed in train_step only when the loss uses them.
  soft_teacher = teacher_params if loss.distill_weight > 0 else None
  if start == 0 and alpha_samples is not None:
    evaluate(0)  # Where the draft starts from.
  stream = training.batch_stream(train_pairs, batch_size, seed, start_step=start,
                                 quantum=length_quantum)
  started, window_tokens, metrics, sources = time.time(), 0.0, None, {}
  for step in range(start, num_steps):
    batch = next(stream)
    if divergence is None:
      params, opt_state, metrics = training.train_step(
          params, opt_state, batch, config=model, optimizer=tx, loss_config=loss,
          teacher_params=soft_teacher, teacher_config=teacher_model if soft_teacher else None,
          dropout_rng=training.dropout_key(seed, step) if model.dropout_rate > 0 else None)
    else:
      source = distillation.batch_source(data_mix, seed, step)
      sources[source] = sources.get(source, 0) + 1
      batch = distillation.on_policy_batch(
          batch, source, distillation.step_key(seed, step), mix=data_mix,
          max_decode_length=target_length, draft_params={'params': params},
          draft_config=model, teacher_params={'params': teacher_params},
          teacher_config=teacher_model, quantum=length_quantum)
      params, opt_state, metrics = distillation.distill_step(
          params, opt_state, batch, teacher_params, config=model,
          teacher_config=teacher_model, optimizer=tx, divergence=divergence)
    window_tokens += float(metrics['tokens'])
    done = step + 1
    if done % log_every == 0 or done == num_steps:
      elapsed = time.time() - started
      if divergence is None:
        details = f'xent {float(metrics["cross_entropy"]):.4f}'
      else:
        details = (f'{divergence.name} {float(metrics["divergence"]):.4f} batch beta '
                   f'T=1 {float(metrics["batch_beta_t1"]):.4f} '
                   f'T=0 {float(metrics["batch_beta_t0"]):.4f} sources '
                   + ' '.join(f'{name} {count}' for name, count in sorted(sources.items())))
      print(f'step {done}/{num_steps} loss {float(metrics["loss"]):.4f} {details} '
            f'grad_norm {float(metrics["grad_norm"]):.3f} '
            f'{window_tokens / elapsed:.0f} target tokens/s', flush=True)
      started, window_tokens, sources = time.time(), 0.0, {}
    if done % eval_every == 0 or done == num_steps:
      evaluate(done)
    if done % checkpoint_every == 0 or done == num_steps:
      _save(checkpoint_dir, params, opt_state, done, keep_checkpoints)
  return params


def main(argv: list[str] | None = None):
  argv = sys.argv[1:] if argv is None else argv
  gin_flags.parse(argv, description=__doc__.split('\n\n')[0], config_dirs=('train',))
  train()


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())
