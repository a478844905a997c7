"""Trains an encoder-sharing draft decoder against a frozen target; gin-configured, resumable.

  python scripts/train_shared_encoder_draft.py \
      --gin_file=configs/train/ende_draft_shared_encoder.gin

The draft (jaxspec.model.shared_encoder_draft) cross-attends to the target's encoder
output; the target is loaded from train_shared_encoder_draft.target_checkpoint and
never updated (jaxspec.training.shared_encoder). Checkpoints are T5X legacy ones of
the draft's tree, with the optimizer state beside them, as scripts/train.py writes
them; started again with the same config it resumes from the latest checkpoint,
feeding the batches an uninterrupted run would.
"""

from __future__ import annotations

import os
import sys
import time


import gin
import jax

from jaxspec.launch import command, gin_flags
import jaxspec.configurables  # noqa: F401  (registers the dataclasses with gin)
from jaxspec.launch import train as train_script
from jaxspec.training import (distillation, shared_encoder as shared_encoder_training,
                              core as training)
from jaxspec import errors, inference
from jaxspec.checkpoints import shared_encoder_draft as draft_checkpoints
from jaxspec.config import T5Config
from jaxspec.data import corpora
from jaxspec.model import shared_encoder_draft


def _evaluate(params, batches, target_params, *, model, encoder_dim, target_model):
  """(reference cross-entropy, token accuracy, argmax agreement with the target)."""
  totals = [0.0, 0.0, 0.0, 0.0]
  for batch in batches:
    sums = shared_encoder_training.eval_step(
        params, batch, target_params, config=model, encoder_dim=encoder_dim,
        target_config=target_model)
    totals = [total + float(value) for total, value in zip(totals, sums)]
  nll, correct, agree, count = totals
  return nll / count, correct / count, agree / count


@gin.configurable
def train_shared_encoder_draft(
    *, model: T5Config = gin.REQUIRED, target_model: T5Config = gin.REQUIRED,
    target_checkpoint: str = gin.REQUIRED, checkpoint_dir: str = gin.REQUIRED,
    encoder_dim: int | None = None, corpus: str = 'ende', input_length: int = 64,
    target_length: int = 64, batch_size: int = 64, num_steps: int = 2000,
    optimizer: training.OptimizerConfig = training.OptimizerConfig(),
    loss: training.LossConfig = training.LossConfig(distill_weight=0.5),
    init_from_target_decoder: bool = False,
    init_from_target_layers: tuple[int, ...] | None = None, checkpoint_every: int = 250,
    keep_checkpoints: int = 2, eval_every: int = 250, eval_examples: int = 512,
    log_every: int = 25, seed: int = 0, max_train_examples: int | None = None,
    length_quantum: int = training.LENGTH_QUANTUM,
    data_mix: distillation.DataMixConfig = distillation.DataMixConfig(),
    input_noise: float = 0.0):
  """Trains the draft decoder `model` over the frozen target's encoder output.

  encoder_dim: the target's emb_dim (the default); the draft projects it to its own
  width when they differ. init_from_target_decoder: start from the target's decoder
  (same width and decoder shape only) instead of a random initialization.
  init_from_target_layers: start from these target decoder layers, in order (a
  layer-pruned draft of the target's width, model.num_decoder_layers of them).
  length_quantum: batches are padded to its length buckets (as scripts/train.py).
  data_mix: each step's target sequences, drawn per step as scripts/train.py does:
    the references, or the target's samples or greedy outputs decoded from the step's
    inputs (the draft's own samples are not offered: it has no encoder to decode with).
  input_noise: for steps whose sequences the target decodes, the share of input tokens
    replaced by random pieces first (`distillation.noised_inputs`): a target that fits its
    training split decodes noised inputs as it decodes held-out ones.
  Validation reports, besides cross-entropy and agreement on the references, alpha at
  temperature 0 on the target's own greedy outputs for the validation inputs (the
  share of those positions where the draft's argmax is the target's token).
  """
  encoder_dim = target_model.emb_dim if encoder_dim is None else encoder_dim
  if data_mix.draft_samples > 0:
    raise errors.InvalidSetting('data_mix.draft_samples: an encoder-sharing draft is not decoded '
                                'stand-alone here; use references, target_samples or target_greedy')
  if not 0.0 <= input_noise < 1.0:
    raise errors.InvalidSetting(f'input_noise must be in [0, 1), got {input_noise}')
  if encoder_dim != target_model.emb_dim:
    raise errors.InvalidSetting(
        f'encoder_dim {encoder_dim} differs from the target emb_dim {target_model.emb_dim}: '
        'the draft reads the target encoder output')
  os.makedirs(checkpoint_dir, exist_ok=True)
  with open(os.path.join(checkpoint_dir, 'config.gin'), 'w') as f:
    f.write(gin.operative_config_str())
  vocab = corpora.Vocabulary()
  if vocab.vocab_size > model.vocab_size:
    raise errors.InvalidSetting(f'the vocabulary has {vocab.vocab_size} pieces but the draft only '
                                f'{model.vocab_size} embeddings')
  train_pairs = corpora.encoded_split(corpus, 'train', vocab, input_length, target_length,
                                      max_train_examples)
  eval_pairs = corpora.encoded_split(corpus, 'validation', vocab, input_length,
                                     target_length, eval_examples)
  eval_batches = training.epoch_batches(eval_pairs, batch_size, seed, 0, length_quantum)
  tx = training.make_optimizer(optimizer, num_steps)
  target_params = inference.load_model_params(target_checkpoint, target_model)
  eval_inputs = [ids for ids, _ in eval_pairs]
  eval_target_batches = training.epoch_batches(
      list(zip(eval_inputs, distillation.greedy_targets(target_params, target_model, eval_inputs,
                                                        target_length, quantum=length_quantum))),
      batch_size, seed, 0, length_quantum)

  if init_from_target_decoder and init_from_target_layers:
    raise errors.InvalidSetting('set init_from_target_decoder or init_from_target_layers, not both')
  if init_from_target_layers and len(init_from_target_layers) != model.num_decoder_layers:
    raise errors.InvalidSetting(
        f'init_from_target_layers names {len(init_from_target_layers)} layers; the draft has '
        f'num_decoder_layers={model.num_decoder_layers}')
  if init_from_target_decoder or init_from_target_layers:
    params = shared_encoder_draft.from_target_decoder(
        target_params,
        tuple(init_from_target_layers) if init_from_target_layers else None)['params']
    # Own buffers: the training step donates the draft's params, never the target's.
    params = jax.tree_util.tree_map(lambda x: jax.numpy.array(x, copy=True), params)
    draft_checkpoints.check_params(params, model, encoder_dim)
  else:
    params = shared_encoder_draft.init_params(model, encoder_dim,
                                              jax.random.PRNGKey(seed))['params']
  opt_state = tx.init(params)
  params, opt_state, start = train_script.resume(
      checkpoint_dir, params, opt_state,
      lambda: draft_checkpoints.load(checkpoint_dir, model, encoder_dim,
                                     dtype=model.param_dtype))
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  print(f'{n_params / 1e6:.2f}M draft decoder parameters over the target encoder '
        f'(width {encoder_dim}), {len(train_pairs)} training examples, '
        f'steps {start}..{num_steps}', flush=True)

  stream = training.batch_stream(train_pairs, batch_size, seed, start_step=start,
                                 quantum=length_quantum)
  started, window_tokens = time.time(), 0.0
  for step in range(start, num_steps):
    batch = next(stream)
    source = distillation.batch_source(data_mix, seed, step)
    if source != 'references':
      batch = dict(batch, inputs=distillation.noised_inputs(
          batch['inputs'], input_noise, target_model.vocab_size, seed, step))
      batch = distillation.on_policy_batch(
          batch, source, distillation.step_key(seed, step), mix=data_mix,
          max_decode_length=target_length, draft_params=None, draft_config=None,
          teacher_params=target_params, teacher_config=target_model, quantum=length_quantum)
    params, opt_state, metrics = shared_encoder_training.train_step(
        params, opt_state, batch, target_params, config=model,
        encoder_dim=encoder_dim, optimizer=tx, loss_config=loss, target_config=target_model)
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
      nll, accuracy, agreement = _evaluate(
          params, eval_batches, target_params, model=model, encoder_dim=encoder_dim,
          target_model=target_model)
      _, _, alpha_greedy = _evaluate(
          params, eval_target_batches, target_params, model=model, encoder_dim=encoder_dim,
          target_model=target_model)
      print(f'step {done} validation xent {nll:.4f} token accuracy {accuracy:.4f} '
            f'argmax agreement with the target {agreement:.4f} alpha T=0 on the '
            f"target's greedy outputs {alpha_greedy:.4f}", flush=True)
    if done % checkpoint_every == 0 or done == num_steps:
      train_script._save(checkpoint_dir, params, opt_state, done, keep_checkpoints)
  return params


def main(argv: list[str] | None = None):
  argv = sys.argv[1:] if argv is None else argv
  gin_flags.parse(argv, description=__doc__.split('\n\n')[0], config_dirs=('train',))
  train_shared_encoder_draft()


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())
