"""Training and distillation of T5 pairs: batching, losses, one jitted step.

The loss is T5X's: token cross-entropy over non-padding targets plus a small z-loss
on log Z. Distillation (paper Section 6: soft targets from the target model, the
way to raise alpha) mixes in the cross-entropy against the teacher's distribution.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.config import T5Config
from jaxspec.model import T5

LENGTH_QUANTUM = 16  # Batches up to 4 quanta long are padded to a multiple of this.
DROPOUT_STREAM = 0x64726f70  # Folded into the run's seed for the dropout keys ('drop').


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  name: str = 'adafactor'  # 'adafactor' (as T5X) or 'adamw'.
  learning_rate: float = 1e-2  # Peak rate.
  warmup_steps: int = 500
  # 'rsqrt': T5X's peak * sqrt(warmup / max(step, warmup)); 'cosine': to zero at num_steps.
  decay: str = 'rsqrt'
  weight_decay: float = 0.0  # adamw only.
  # Adafactor only: scale updates by each parameter's RMS (T5X's default), so the
  # learning rate is a relative step size.
  multiply_by_parameter_scale: bool = True
  clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class LossConfig:
  z_loss: float = 1e-4
  distill_weight: float = 0.0  # 0: hard targets only; 1: teacher's distribution only.
  distill_temperature: float = 1.0


def learning_rate_schedule(config: OptimizerConfig, num_steps: int):
  warmup = max(config.warmup_steps, 1)
  if config.decay == 'rsqrt':
    return lambda step: config.learning_rate * jnp.minimum(
        (step + 1) / warmup, jnp.sqrt(warmup / jnp.maximum(step + 1, warmup)))
  if config.decay == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup,
                                              max(num_steps, warmup + 1))
  raise ValueError(f"decay must be 'rsqrt' or 'cosine', got {config.decay!r}")


def make_optimizer(config: OptimizerConfig, num_steps: int) -> optax.GradientTransformation:
  """Gradient clipping, then Adafactor or AdamW on the configured schedule.

  Equal settings give the same (stateless) object, so a jitted step that takes it as a
  static argument compiles once per process, not once per run; num_steps counts only
  for the cosine schedule.
  """
  return _cached_optimizer(config, num_steps if config.decay == 'cosine' else 0)


@functools.lru_cache(maxsize=16)
def _cached_optimizer(config: OptimizerConfig, num_steps: int) -> optax.GradientTransformation:
  schedule = learning_rate_schedule(config, num_steps)
  if config.name == 'adafactor':
    core = optax.adafactor(
        schedule, multiply_by_parameter_scale=config.multiply_by_parameter_scale)
  elif config.name == 'adamw':
    core = optax.adamw(schedule, weight_decay=config.weight_decay)
  else:
    raise ValueError(f"optimizer must be 'adafactor' or 'adamw', got {config.name!r}")
  return optax.chain(optax.clip_by_global_norm(config.clip_norm), core)


def length_bucket(length: int, quantum: int = LENGTH_QUANTUM) -> int:
  """The padded length of a batch side: a multiple of quantum up to 4 quanta, then the
  next of 6, 8, 12, 16, 24, ... quanta, so long inputs compile a few shapes, not dozens.
  Each bucket compiles once: on CPU short buckets save work, on an accelerator (where
  padding is free and a compile is slow) a quantum as long as the inputs gives one shape.
  """
  bucket = max(quantum, -(-length // quantum) * quantum)
  if bucket <= 4 * quantum:
    return bucket
  size = 4 * quantum
  while size < length:
    size = size * 3 // 2 if (size // quantum) & (size // quantum - 1) == 0 else size * 4 // 3
  return size


def pad_batch(pairs: Sequence[tuple[list[int], list[int]]],
              quantum: int = LENGTH_QUANTUM) -> dict[str, np.ndarray]:
  """(input ids, target ids) pairs -> {'inputs', 'targets', 'decoder_inputs'} [b, len].

  Each side is padded with 0 to its length bucket (`length_bucket`); decoder inputs are the
  targets shifted right behind the start token 0.
  """
  input_length = length_bucket(max(len(p[0]) for p in pairs), quantum)
  target_length = length_bucket(max(len(p[1]) for p in pairs), quantum)
  inputs = np.zeros((len(pairs), input_length), np.int32)
  targets = np.zeros((len(pairs), target_length), np.int32)
  for row, (input_ids, target_ids) in enumerate(pairs):
    inputs[row, :len(input_ids)] = input_ids
    targets[row, :len(target_ids)] = target_ids
  decoder_inputs = np.pad(targets[:, :-1], ((0, 0), (1, 0)))
  return {'inputs': inputs, 'targets': targets, 'decoder_inputs': decoder_inputs}


def epoch_batches(pairs: Sequence[tuple[list[int], list[int]]], batch_size: int,
                  seed: int, epoch: int,
                  quantum: int = LENGTH_QUANTUM) -> list[dict[str, np.ndarray]]:
  """One epoch of batches in a deterministic order fixed by (seed, epoch).

  Examples of similar length share a batch (sorted within shuffled chunks), which
  keeps padding and the number of shapes small. Each batch also names its rows' indices
  in `pairs` ('example_ids' [b]), for data stored per example.
  """
  order = np.random.RandomState([seed, epoch]).permutation(len(pairs))
  chunk = batch_size * 50
  batches = []
  for start in range(0, len(order), chunk):
    block = sorted(order[start:start + chunk], key=lambda i: (len(pairs[i][1]), len(pairs[i][0])))
    for offset in range(0, len(block) - batch_size + 1, batch_size):
      rows = block[offset:offset + batch_size]
      batches.append({**pad_batch([pairs[i] for i in rows], quantum),
                      'example_ids': np.asarray(rows, np.int32)})
  np.random.RandomState([seed, epoch, 1]).shuffle(batches)
  return batches


def batch_stream(pairs, batch_size: int, seed: int, start_step: int = 0,
                 quantum: int = LENGTH_QUANTUM) -> Iterator[dict]:
  """Batches forever, resuming exactly at `start_step` (same order as an unbroken run)."""
  epoch, step = 0, 0
  while True:
    batches = epoch_batches(pairs, batch_size, seed, epoch, quantum)
    if not batches:
      raise ValueError(f'fewer examples ({len(pairs)}) than one batch ({batch_size})')
    for batch in batches:
      if step >= start_step:
        yield batch
      step += 1
    epoch += 1


def token_losses(logits, targets, loss_config: LossConfig, teacher_logits=None):
  """Summed loss and token count over non-padding targets.

  logits [b, t, v] float32, targets [b, t]; teacher_logits [b, t, v] or None.
  """
  mask = (targets > 0).astype(jnp.float32)  # [b, t]
  log_z = jax.nn.logsumexp(logits, axis=-1)  # [b, t]
  log_probs = logits - log_z[..., None]
  hard = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  loss = hard
  if teacher_logits is not None and loss_config.distill_weight > 0:
    teacher_probs = jax.nn.softmax(teacher_logits / loss_config.distill_temperature, axis=-1)
    soft = -jnp.sum(teacher_probs * log_probs, axis=-1)
    loss = (1 - loss_config.distill_weight) * hard + loss_config.distill_weight * soft
  loss = loss + loss_config.z_loss * jnp.square(log_z)
  return jnp.sum(loss * mask), jnp.sum(mask), jnp.sum(hard * mask)


def dropout_key(seed: int, step: int):
  """The dropout key of training step `step` of a run seeded `seed`: a resumed run drops
  what an uninterrupted one does."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), DROPOUT_STREAM),
                            step)


@functools.partial(jax.jit, static_argnames=('config', 'optimizer', 'loss_config',
                                             'teacher_config'), donate_argnums=(0, 1))
def train_step(params, opt_state, batch, *, config: T5Config,
               optimizer: optax.GradientTransformation, loss_config: LossConfig,
               teacher_params=None, teacher_config: T5Config | None = None,
               dropout_rng=None):
  """One optimizer step; returns (params, opt_state, metrics).

  dropout_rng: the step's key for dropout (`dropout_key`), needed when
  config.dropout_rate > 0; the teacher never drops."""
  dropping = config.dropout_rate > 0
  if dropping and dropout_rng is None:
    raise ValueError(f'config.dropout_rate is {config.dropout_rate}: train_step needs the '
                     "step's dropout_rng (training.dropout_key(seed, step))")
  teacher_logits = None
  if teacher_params is not None:
    teacher_logits = jax.lax.stop_gradient(T5(teacher_config).apply(
        {'params': teacher_params}, batch['inputs'], batch['decoder_inputs']))

  def logits_fn(p):
    return T5(config, deterministic=not dropping).apply(
        {'params': p}, batch['inputs'], batch['decoder_inputs'],
        rngs={'dropout': dropout_rng} if dropping else None)

  return descend(params, opt_state, optimizer, logits_fn, batch['targets'], loss_config,
                 teacher_logits)


def descend(params, opt_state, optimizer: optax.GradientTransformation, logits_fn, targets,
            loss_config: LossConfig, teacher_logits=None):
  """One optimizer step on the token loss of logits_fn(params) [b, t, v] against
  targets [b, t] (and the teacher's logits); -> params, opt_state, metrics."""
  def loss_fn(p):
    total, count, hard = token_losses(logits_fn(p), targets, loss_config, teacher_logits)
    return total / jnp.maximum(count, 1.0), (count, hard)

  (loss, (count, hard)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  metrics = {'loss': loss, 'cross_entropy': hard / jnp.maximum(count, 1.0),
             'tokens': count, 'grad_norm': optax.tree.norm(grads)}
  return params, opt_state, metrics


@functools.partial(jax.jit, static_argnames=('config',))
def eval_step(params, batch, *, config: T5Config):
  """Summed token cross-entropy, correct argmax tokens, and token count of a batch."""
  logits = T5(config).apply({'params': params}, batch['inputs'], batch['decoder_inputs'])
  mask = batch['targets'] > 0
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_probs, batch['targets'][..., None], axis=-1)[..., 0]
  correct = (jnp.argmax(logits, axis=-1) == batch['targets']) & mask
  return jnp.sum(nll * mask), jnp.sum(correct), jnp.sum(mask)
