"""Trains a feature-level draft head against a frozen target; gin-configured, resumable.

  python scripts/train_feature_draft.py --gin_file=configs/train/ende54m_feature_head.gin

The head (jaxspec.model.feature_draft, drafted with jaxspec.FeatureDrafter) reads the
target's final hidden states and the next token's embedding; the target is loaded from
train_feature_draft.target_checkpoint and never updated (jaxspec.training.feature_draft).
Checkpoints are T5X legacy ones of the head's tree, with the optimizer state beside them,
as scripts/train.py writes them; started again with the same config the run resumes from
the latest checkpoint, feeding the batches an uninterrupted run would.

`train_feature_draft.sequence_kd` trains on the target's own greedy outputs for the training
inputs instead of the references (what the head drafts at temperature 0), decoded once and
kept in `sequence_kd_cache_dir`; `feature_store_dir` keeps the target's features for every
training example there (jaxspec.training.target_features), computed once, so a step runs
only the head and the LM head instead of the whole target. `extra_inputs` names an
inputs-only corpus (jaxspec.data.corpora.INPUTS_ONLY, such as `ende_inputs`) whose inputs
join the training set with the target's greedy outputs as their targets (decoded, cached
and stored apart from the corpus's own, so adding them reuses what a run already has).
`init_checkpoint` starts a new run from a trained head instead of the target's last layer.
`feature_layers` (EAGLE-3's fused features) has the head read those target decoder layers'
outputs beside h; a head trained on h alone starts such a run unchanged (its new `fuse`
rows zero), and the stores of features are kept apart by their layers.

Validation reports the head's argmax agreement with the target on the target's own greedy
outputs for the validation inputs: pass 0 is alpha at temperature 0 of a proposal's
first draft, pass k that of a draft reading k of the head's own predicted features.
"""

from __future__ import annotations

import os
import sys
import time

import gin
import jax
import numpy as np

from jaxspec.launch import command, gin_flags
import jaxspec.configurables  # noqa: F401  (registers the dataclasses with gin)
from jaxspec.launch import train as train_script
from jaxspec.training import core as training, distillation, feature_draft as feature_training
from jaxspec.training import target_features
from jaxspec import errors, inference
from jaxspec.checkpoints import feature_draft as head_checkpoints
from jaxspec.config import T5Config
from jaxspec.data import corpora
from jaxspec.model import feature_draft


def _agreement(params, batches, target_params, *, config, target_model, unroll,
               feature_layers=()):
  """Argmax agreement with the target per pass over `batches`."""
  agree, count = np.zeros(unroll), 0.0
  for batch in batches:
    batch_agree, batch_count = feature_training.eval_step(
        params, batch, target_params, config=config, target_config=target_model,
        unroll=unroll, feature_layers=feature_layers)
    agree, count = agree + np.asarray(batch_agree), count + float(batch_count)
  return agree / max(count, 1.0)


def _greedy_pairs(pairs, target_params, target_model, target_length, quantum):
  inputs = [ids for ids, _ in pairs]
  return list(zip(inputs, distillation.greedy_targets(target_params, target_model, inputs,
                                                      target_length, quantum=quantum)))


@gin.configurable
def train_feature_draft(
    *, target_model: T5Config = gin.REQUIRED, target_checkpoint: str = gin.REQUIRED,
    checkpoint_dir: str = gin.REQUIRED, num_layers: int = 1, corpus: str = 'ende',
    input_length: int = 64, target_length: int = 64, batch_size: int = 64,
    num_steps: int = 3000,
    optimizer: training.OptimizerConfig = training.OptimizerConfig(name='adamw',
                                                                   learning_rate=1e-3),
    loss: feature_training.FeatureLossConfig = feature_training.FeatureLossConfig(),
    init_from_target: bool = True, checkpoint_every: int = 250, keep_checkpoints: int = 2,
    eval_every: int = 250, eval_examples: int = 512, log_every: int = 25, seed: int = 0,
    max_train_examples: int | None = None, sequence_kd: bool = False,
    sequence_kd_cache_dir: str | None = None, feature_store_dir: str | None = None,
    extra_inputs: str | None = None, init_checkpoint: str | None = None,
    feature_layers: tuple[int, ...] = (), length_quantum: int = training.LENGTH_QUANTUM):
  """Trains a head of `num_layers` decoder layers over the frozen target.

  init_from_target: start from the target's last decoder layer, relative position bias
  and final norm (feature_draft.from_target) instead of a random initialization.
  sequence_kd: train on the target's greedy outputs (cached in sequence_kd_cache_dir).
  feature_store_dir: compute the target's features once and keep them there (module
  docstring); None runs the target in every step.
  extra_inputs: an inputs-only corpus added to the training inputs (needs sequence_kd).
  max_train_examples: the first this many examples of each part (the corpus's training
  split, and extra_inputs') where set; None: all.
  init_checkpoint: a head checkpoint (directory) a run without checkpoints starts from.
  feature_layers: target decoder layers (0-based) whose outputs the head reads beside h.
  """
  feature_layers = tuple(feature_layers)
  feature_draft.check_feature_layers(feature_layers, target_model)
  if extra_inputs and not sequence_kd:
    raise errors.InvalidSetting(
        f'train_feature_draft.extra_inputs ({extra_inputs!r}) has no references: its '
        'targets are the target\'s greedy outputs, so set train_feature_draft.sequence_kd = True')
  if extra_inputs and corpora.INPUTS_ONLY.get(extra_inputs) != corpus:
    raise errors.InvalidSetting(
        f'train_feature_draft.extra_inputs must be an inputs-only corpus of {corpus!r} '
        f'({", ".join(k for k, v in corpora.INPUTS_ONLY.items() if v == corpus) or "none"}), '
        f'got {extra_inputs!r}')
  config = feature_draft.head_config(target_model, num_layers)
  os.makedirs(checkpoint_dir, exist_ok=True)
  with open(os.path.join(checkpoint_dir, 'config.gin'), 'w') as f:
    f.write(gin.operative_config_str())
  vocab = corpora.Vocabulary()
  train_pairs = corpora.encoded_split(corpus, 'train', vocab, input_length, target_length,
                                      max_train_examples)
  eval_pairs = corpora.encoded_split(corpus, 'validation', vocab, input_length,
                                     target_length, eval_examples)
  tx = training.make_optimizer(optimizer, num_steps)
  target_params = inference.load_model_params(target_checkpoint, target_model)
  parts = [train_pairs]
  if extra_inputs:
    parts.append(corpora.encoded_split(extra_inputs, 'train', vocab, input_length,
                                       target_length, max_train_examples))
  if sequence_kd:
    parts = [distillation.sequence_kd_pairs(part, target_params['params'], target_model,
                                            target_length, sequence_kd_cache_dir, batch_size,
                                            length_quantum)
             for part in parts]
  train_pairs = [pair for part in parts for pair in part]
  store = None
  if feature_store_dir:
    store = target_features.concatenate([
        target_features.cached(feature_store_dir, target_params, target_model, part,
                               batch_size, length_quantum, feature_layers)
        for part in parts])
  eval_batches = training.epoch_batches(
      _greedy_pairs(eval_pairs, target_params, target_model, target_length, length_quantum),
      batch_size, seed, 0, length_quantum)

  if init_from_target:
    params = feature_draft.from_target(target_params, config, jax.random.PRNGKey(seed),
                                       num_feature_layers=len(feature_layers))
  else:
    params = feature_draft.init_params(config, jax.random.PRNGKey(seed),
                                       num_feature_layers=len(feature_layers))
  params = jax.tree_util.tree_map(lambda x: jax.numpy.array(x, copy=True), params['params'])
  head_checkpoints.check_params(params, config, len(feature_layers))
  if init_checkpoint and not train_script.latest_step(checkpoint_dir):
    params = jax.device_put(head_checkpoints.load_widened(init_checkpoint, config,
                                                          len(feature_layers)))
    print(f'initialized from {init_checkpoint}', flush=True)
  params, opt_state, start = train_script.resume(
      checkpoint_dir, params, tx.init(params),
      lambda: head_checkpoints.load(checkpoint_dir, config,
                                    num_feature_layers=len(feature_layers)))
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  print(f'{n_params / 1e6:.2f}M head parameters ({num_layers} layer(s) of width '
        f'{config.emb_dim}) over the frozen target, {len(train_pairs)} training examples, '
        f'steps {start}..{num_steps}', flush=True)

  stream = training.batch_stream(train_pairs, batch_size, seed, start_step=start,
                                 quantum=length_quantum)
  started, window_tokens = time.time(), 0.0
  for step in range(start, num_steps):
    batch = next(stream)
    if store is not None:
      batch = {**batch, **target_features.batch(store, batch['example_ids'],
                                                batch['targets'].shape[1],
                                                batch['inputs'].shape[1])}
    rng = training.dropout_key(seed, step)
    params, opt_state, metrics = feature_training.train_step(
        params, opt_state, batch, target_params, rng, config=config,
        target_config=target_model, optimizer=tx, loss=loss, feature_layers=feature_layers)
    window_tokens += float(np.sum(batch['targets'] > 0))
    done = step + 1
    if done % log_every == 0 or done == num_steps:
      elapsed = time.time() - started
      agreement = ' '.join(f'{a:.3f}' for a in np.asarray(metrics['agreement']))
      print(f'step {done}/{num_steps} loss {float(metrics["loss"]):.4f} '
            f'regression {float(metrics["regression"][0]):.4f} '
            f'xent {float(metrics["cross_entropy"][0]):.4f} agreement {agreement} '
            f'grad_norm {float(metrics["grad_norm"]):.3f} '
            f'{window_tokens / elapsed:.0f} tokens/s', flush=True)
      started, window_tokens = time.time(), 0.0
    if done % eval_every == 0 or done == num_steps:
      agreement = _agreement(params, eval_batches, target_params, config=config,
                             target_model=target_model, unroll=max(loss.unroll, 3),
                             feature_layers=feature_layers)
      print(f"step {done} validation: argmax agreement on the target's greedy outputs by "
            f'draft step {" ".join(f"{a:.4f}" for a in agreement)}', flush=True)
    if done % checkpoint_every == 0 or done == num_steps:
      train_script._save(checkpoint_dir, params, opt_state, done, keep_checkpoints)
  return params


def main(argv: list[str] | None = None):
  argv = sys.argv[1:] if argv is None else argv
  gin_flags.parse(argv, description=__doc__.split('\n\n')[0], config_dirs=('train',))
  train_feature_draft()


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())
