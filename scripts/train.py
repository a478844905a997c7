"""Trains (or distills) a T5 on a shipped corpus; gin-configured, resumable.

  python scripts/train.py --gin_file=configs/train/ende_target.gin \
      --gin.train.num_steps=2000

Writes T5X legacy checkpoints (checkpoint_<step>/) and the optimizer state
(optimizer_<step>.msgpack) into train.checkpoint_dir, plus config.gin. Started again
with the same config it resumes from the latest checkpoint, feeding the same batches
an uninterrupted run would.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flax.serialization
import gin
import jax
import jax.numpy as jnp
import numpy as np

import gin_flags  # scripts/gin_flags.py
import jaxspec.configurables  # noqa: F401  (registers the dataclasses with gin)
from jaxspec.checkpoints import t5x as t5x_checkpoints
from jaxspec.config import T5Config
from jaxspec.data import corpora
from jaxspec.model import init_params
from jaxspec import training


def _atomic_write(path: str, contents: bytes):
  tmp = f'{path}.tmp-{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(contents)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _encoded_pairs(corpus: str, split: str, vocab, input_length: int, target_length: int,
                   limit: int | None = None):
  examples = corpora.load_split(corpus, split)[:limit]
  return [corpora.encode_example(e, corpus, vocab, input_length, target_length)
          for e in examples]


def _latest_step(checkpoint_dir: str) -> int | None:
  try:
    location = t5x_checkpoints.find_t5x_checkpoint(checkpoint_dir)
  except FileNotFoundError:
    return None
  return int(os.path.basename(location.directory).split('_')[-1])


def _save(checkpoint_dir: str, params, opt_state, step: int, keep: int):
  # The optimizer state goes first: a checkpoint_<step> with no optimizer file
  # beside it can only mean a crash between the two writes, and resumes fresh.
  _atomic_write(os.path.join(checkpoint_dir, f'optimizer_{step}.msgpack'),
                flax.serialization.to_bytes(jax.device_get(opt_state)))
  t5x_checkpoints.save_t5x_checkpoint(checkpoint_dir, jax.device_get(params), step)
  steps = sorted(int(n.split('_')[1]) for n in os.listdir(checkpoint_dir)
                 if n.startswith('checkpoint_') and n.split('_')[1].isdigit())
  for old in steps[:-keep]:
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


@gin.configurable
def train(*, model: T5Config = gin.REQUIRED, checkpoint_dir: str = gin.REQUIRED,
          corpus: str = 'ende', input_length: int = 64, target_length: int = 64,
          batch_size: int = 64, num_steps: int = 2000,
          optimizer: training.OptimizerConfig = training.OptimizerConfig(),
          loss: training.LossConfig = training.LossConfig(),
          teacher_model: T5Config | None = None, teacher_checkpoint: str | None = None,
          checkpoint_every: int = 250, keep_checkpoints: int = 2, eval_every: int = 250,
          eval_examples: int = 512, log_every: int = 25, seed: int = 0,
          max_train_examples: int | None = None):
  """Trains `model` on `corpus` for num_steps; distills when a teacher is given."""
  os.makedirs(checkpoint_dir, exist_ok=True)
  with open(os.path.join(checkpoint_dir, 'config.gin'), 'w') as f:
    f.write(gin.operative_config_str())
  vocab = corpora.Vocabulary()
  if vocab.vocab_size > model.vocab_size:
    raise ValueError(f'the vocabulary has {vocab.vocab_size} pieces but the model only '
                     f'{model.vocab_size} embeddings')
  train_pairs = _encoded_pairs(corpus, 'train', vocab, input_length, target_length,
                               max_train_examples)
  eval_batches = training.epoch_batches(
      _encoded_pairs(corpus, 'validation', vocab, input_length, target_length, eval_examples),
      batch_size, seed, 0)
  tx = training.make_optimizer(optimizer, num_steps)

  teacher_params = None
  if teacher_checkpoint:
    teacher_params = jax.device_put(t5x_checkpoints.load_t5x_checkpoint(
        teacher_checkpoint, teacher_model, dtype=teacher_model.param_dtype))

  params = init_params(model, jax.random.PRNGKey(seed))['params']
  opt_state = tx.init(params)
  start = _latest_step(checkpoint_dir) or 0
  if start:
    params = jax.device_put(t5x_checkpoints.load_t5x_checkpoint(
        checkpoint_dir, model, dtype=model.param_dtype))
    optimizer_file = os.path.join(checkpoint_dir, f'optimizer_{start}.msgpack')
    if os.path.exists(optimizer_file):
      with open(optimizer_file, 'rb') as f:
        opt_state = flax.serialization.from_bytes(opt_state, f.read())
    else:
      print(f'no optimizer state for step {start}: it restarts from scratch', flush=True)
    print(f'resuming from step {start}', flush=True)
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  print(f'{n_params / 1e6:.2f}M parameters, {len(train_pairs)} training examples, '
        f'steps {start}..{num_steps}', flush=True)

  stream = training.batch_stream(train_pairs, batch_size, seed, start_step=start)
  started, window_tokens, metrics = time.time(), 0.0, None
  for step in range(start, num_steps):
    params, opt_state, metrics = training.train_step(
        params, opt_state, next(stream), config=model, optimizer=tx, loss_config=loss,
        teacher_params=teacher_params, teacher_config=teacher_model if teacher_params else None)
    window_tokens += float(metrics['tokens'])
    done = step + 1
    if done % log_every == 0 or done == num_steps:
      elapsed = time.time() - started
      print(f'step {done}/{num_steps} loss {float(metrics["loss"]):.4f} '
            f'xent {float(metrics["cross_entropy"]):.4f} '
            f'grad_norm {float(metrics["grad_norm"]):.3f} '
            f'{window_tokens / elapsed:.0f} target tokens/s', flush=True)
      started, window_tokens = time.time(), 0.0
    if done % eval_every == 0 or done == num_steps:
      nll, accuracy = _evaluate(params, eval_batches, model)
      print(f'step {done} validation xent {nll:.4f} token accuracy {accuracy:.4f}', flush=True)
    if done % checkpoint_every == 0 or done == num_steps:
      _save(checkpoint_dir, params, opt_state, done, keep_checkpoints)
  return params


def main(argv):
  gin_flags.parse(argv)
  train()


if __name__ == '__main__':
  main(sys.argv[1:])
