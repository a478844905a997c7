"""jaxspec.model.quantization and jaxspec.decoding.drafters.int8: the target's own decoder
in int8 as a draft. Exact decoding with it rests on the verifier like every drafter;
here: the quantization's arithmetic, the draft's params and cache, its agreement with
the target, and greedy speculative decoding with it token for token the baseline's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import get_config
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import (Int8Drafter, SharedEncoderDrafter,
                                       SharedEncoderDrafterWithTarget)
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import T5, init_params
from jaxspec.model.cpu import layout as kernel_layout
from jaxspec.model.quantization import dequantize_rows, int8_decoder, quantize_rows
from jaxspec.model.shared_encoder_draft import SharedEncoderDraft, from_target_decoder
from jaxspec.sampling import SamplingConfig

CONFIG = get_config('test_tiny_1_1')
MAX_LEN = 12


def test_quantize_rows_round_trips_within_half_a_step():
  w = np.random.default_rng(0).standard_normal((6, 40)).astype(np.float32)
  w[3] = 0.0  # a zero row
  q, scale = quantize_rows(w)
  assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (6,)
  assert np.max(np.abs(q)) == 127 and np.all(np.abs(q) <= 127)
  assert scale[3] == 1.0 and not q[3].any()
  np.testing.assert_allclose(scale[:3], np.max(np.abs(w[:3]), axis=1) / 127, rtol=1e-6)
  error = np.abs(dequantize_rows(q, scale) - w)
  assert np.all(error <= scale[:, None] / 2 + 1e-7)


def test_quantize_rows_rejects_what_it_cannot_quantize():
  with pytest.raises(ValueError, match='2-D'):
    quantize_rows(np.ones((2, 3, 4)))
  with pytest.raises(ValueError, match='NaN or infinity'):
    quantize_rows(np.array([[1.0, np.inf]]))
  with pytest.raises(ValueError, match="'params'"):
    int8_decoder({'decoder': {}})


@functools.cache
def _target():
  params = init_params(CONFIG, jax.random.PRNGKey(3))
  return kernel_layout.transposed_kernels({'params': params['params']})


def _encoder_tokens():
  tokens = np.random.default_rng(5).integers(2, CONFIG.vocab_size, (3, 9)).astype(np.int32)
  tokens[1, 5:] = 0
  tokens[2, 2:] = 0
  return tokens


def test_int8_decoder_quantizes_every_per_step_matrix_and_keeps_the_rest():
  draft = int8_decoder(_target())['params']
  assert 'encoder' not in draft
  assert draft['token_embedder']['embedding_int8'].dtype == np.int8
  layer = draft['decoder']['layers_0']
  for path in (('self_attention', 'query'), ('self_attention', 'out'),
               ('encoder_decoder_attention', 'query'), ('mlp', 'wi_0'), ('mlp', 'wo')):
    leaf = layer[path[0]][path[1]]
    assert set(leaf) == {'kernel_int8', 'kernel_scale'}, path
  # The encoding's projections stay float32: the draft's cross-attention cache is the target's.
  cross = layer['encoder_decoder_attention']['key']
  np.testing.assert_array_equal(
      cross['kernel_t'],
      np.asarray(_target()['params']['decoder']['layers_0']['encoder_decoder_attention']
                 ['key']['kernel_t']))
  # T5X's layout is accepted too.
  t5x = int8_decoder(kernel_layout.t5x_kernels(_target()))['params']
  np.testing.assert_array_equal(t5x['decoder']['layers_0']['mlp']['wo']['kernel_int8'],
                                layer['mlp']['wo']['kernel_int8'])


def test_the_int8_draft_tracks_the_target_decoder():
  drafter = Int8Drafter(CONFIG)
  assert drafter.encoder_dim == CONFIG.emb_dim
  with pytest.raises(ValueError, match='encoder_dim must equal'):
    Int8Drafter(CONFIG, encoder_dim=CONFIG.emb_dim + 1)
  target, tokens = _target(), jnp.asarray(_encoder_tokens())
  model = T5(CONFIG)
  encoded = model.apply(target, tokens, method=T5.encode)
  target_cache = model.apply(target, encoded, tokens, 6, method=T5.init_cache)
  params = drafter.draft_params(target)
  draft_cache = drafter.init_state_from_target(params, tokens, encoded, 6)
  for mine, theirs in zip(draft_cache.layers, target_cache.layers):
    np.testing.assert_array_equal(mine.cross_keys, theirs.cross_keys)
  # What speculative decoding builds: the target's cross cache shared, not recomputed.
  shared = drafter.init_state_from_target_cache(params, target_cache, 9)
  jax.tree_util.tree_map(np.testing.assert_array_equal, shared,
                         drafter.init_state_from_target(params, tokens, encoded, 9))
  decoder_tokens = jnp.asarray([[0, 7, 9, 11]] * 3, jnp.int32)
  target_logits, _ = model.apply(target, decoder_tokens, target_cache, method=T5.decode)
  draft_logits, _ = SharedEncoderDraft(CONFIG, CONFIG.emb_dim).apply(
      params, decoder_tokens, draft_cache, method=SharedEncoderDraft.decode)
  spread = float(jnp.std(target_logits))
  assert float(jnp.max(jnp.abs(draft_logits - target_logits))) < 0.1 * spread
  assert float(jnp.max(jnp.abs(draft_logits - target_logits))) > 0  # int8, not a copy


def test_stand_alone_wrapper_shares_the_target_cache_only_for_the_int8_draft():
  """SharedEncoderDrafterWithTarget (the benchmark's stand-alone drafters) passes the
  target's cross cache on to an int8 draft and falls back to the encoding otherwise."""
  target, tokens = _target(), jnp.asarray(_encoder_tokens())
  model = T5(CONFIG)
  encoded = model.apply(target, tokens, method=T5.encode)
  target_cache = model.apply(target, encoded, tokens, 6, method=T5.init_cache)
  int8 = SharedEncoderDrafterWithTarget(Int8Drafter(CONFIG), CONFIG)
  params = {'draft': Int8Drafter.draft_params(target), 'target': target}
  # Marked cross keys: only a state taken from the cache carries them.
  marked = target_cache.replace(layers=tuple(
      layer.replace(cross_keys=layer.cross_keys + 1.0) for layer in target_cache.layers))
  shared = int8.init_state_for_decode(params, tokens, encoded, 9, marked)
  for mine, theirs in zip(shared.layers, marked.layers):
    np.testing.assert_array_equal(mine.cross_keys, theirs.cross_keys)
  # A trained encoder-sharing draft has its own cross projections: no cache to share.
  plain = SharedEncoderDrafterWithTarget(SharedEncoderDrafter(CONFIG, CONFIG.emb_dim), CONFIG)
  assert int8.shares_target_cache and not plain.shares_target_cache
  plain_params = {'draft': from_target_decoder(target), 'target': target}
  state = plain.init_state_for_decode(plain_params, tokens, encoded, 9, target_cache)
  jax.tree_util.tree_map(np.testing.assert_array_equal, state,
                         plain.init_state_from_target(plain_params, tokens, encoded, 9))


@pytest.mark.parametrize('gamma', [1, 4])
def test_greedy_speculative_with_the_int8_draft_is_the_baseline(gamma):
  target, tokens = _target(), _encoder_tokens()
  baseline = generate(target, tokens, config=CONFIG, max_decode_length=MAX_LEN)
  drafter = Int8Drafter(CONFIG)
  result = speculative_generate(target, drafter.draft_params(target), tokens,
                                target_config=CONFIG, drafter=drafter,
                                spec=SpeculativeConfig(gamma=gamma), max_decode_length=MAX_LEN)
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  np.testing.assert_array_equal(result.output.lengths, baseline.lengths)
  assert float(result.stats.alpha) > 0.8  # the target's own decoder, int8


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_the_main_jobs_long_proposals_are_the_baseline(temperature):
  # The main job's settings (configs/infer/ende54m_int8.gin at the gamma 19 it chooses on
  # 2 cores): coupled verification, long proposals, verify steps of 5 or gamma + 1
  # positions. Here gamma is the largest the output allows (MAX_LEN - 1), so the first
  # proposal runs to the drafted EOS or the length limit and later verify steps are wider
  # than what is left of the output: the tokens are still the baseline's, greedy and
  # sampled draw for draw.
  target, tokens = _target(), _encoder_tokens()
  rng, sampling = jax.random.PRNGKey(8), SamplingConfig(temperature=temperature)
  baseline = generate(target, tokens, rng, config=CONFIG, max_decode_length=MAX_LEN,
                      sampling=sampling)
  drafter = Int8Drafter(CONFIG)
  spec = SpeculativeConfig(gamma=MAX_LEN - 1, verification='coupled', verify_lengths=(5,))
  result = speculative_generate(target, drafter.draft_params(target), tokens, rng,
                                target_config=CONFIG, drafter=drafter, spec=spec,
                                max_decode_length=MAX_LEN, sampling=sampling)
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  np.testing.assert_array_equal(result.output.lengths, baseline.lengths)
  assert int(result.stats.target_calls) < int(np.max(baseline.lengths))


def test_sampling_with_the_int8_draft_accepts_nearly_every_draft():
  target, tokens = _target(), _encoder_tokens()
  drafter = Int8Drafter(CONFIG)
  result = speculative_generate(target, drafter.draft_params(target), tokens,
                                jax.random.PRNGKey(4), target_config=CONFIG, drafter=drafter,
                                spec=SpeculativeConfig(gamma=3), max_decode_length=MAX_LEN,
                                sampling=SamplingConfig(temperature=1.0))
  assert float(result.stats.alpha) > 0.8


def test_coupled_sampling_with_the_int8_draft_is_the_baseline():
  # Coupled verification (the main job's): the sampled output is the baseline's draw for
  # draw, and the int8 draft, drawing with the same noise, agrees nearly everywhere,
  # alone and through the stand-alone wrapper.
  target, tokens = _target(), _encoder_tokens()
  rng, sampling = jax.random.PRNGKey(6), SamplingConfig(temperature=1.0)
  baseline = generate(target, tokens, rng, config=CONFIG, max_decode_length=MAX_LEN,
                      sampling=sampling)
  drafter = Int8Drafter(CONFIG)
  spec = SpeculativeConfig(gamma=3, verification='coupled')
  result = speculative_generate(target, drafter.draft_params(target), tokens, rng,
                                target_config=CONFIG, drafter=drafter, spec=spec,
                                max_decode_length=MAX_LEN, sampling=sampling)
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  assert float(result.stats.alpha) > 0.8
  wrapped = SharedEncoderDrafterWithTarget(drafter, CONFIG)
  through_wrapper = speculative_generate(
      target, {'draft': drafter.draft_params(target), 'target': target}, tokens, rng,
      target_config=CONFIG, drafter=wrapped, spec=spec, max_decode_length=MAX_LEN,
      sampling=sampling)
  np.testing.assert_array_equal(through_wrapper.output.tokens, baseline.tokens)
  assert float(through_wrapper.stats.alpha) == float(result.stats.alpha)


# Shapes whose every per-step matrix tiles (outputs multiples of 64).
TILED_CONFIG = get_config('test_tiny_1_1', vocab_size=128, emb_dim=64, num_heads=2,
                          head_dim=32, mlp_dim=128)


def test_tiled_params_hold_the_kernels_tiles_and_decode_bit_for_bit_alike():
  """int8_decoder(tiled=True) stores every matrix in the kernel's tiles (the embedding
  table too, which the lookup reads as well); each form's logits are those of its XLA
  reference up to float32 rounding, wherever the kernel computes them."""
  from jaxspec.model.cpu import matmul as cpu_matmul
  target = kernel_layout.transposed_kernels(
      {'params': init_params(TILED_CONFIG, jax.random.PRNGKey(4))['params']})
  rows_form = int8_decoder(target, tiled=False)['params']
  tiled = int8_decoder(target, tiled=True)['params']
  wo = tiled['decoder']['layers_0']['mlp']['wo']['kernel_int8']
  assert wo.shape == (1, 32, 64, 4)  # [64, 128] as [out / 64, in / 4, 64, 4]
  # One embedding table, tiled: the logits multiply it and the lookup gathers from it.
  assert tiled['token_embedder']['embedding_int8'].shape == (2, 16, 64, 4)
  assert rows_form['token_embedder']['embedding_int8'].shape == (128, 64)
  np.testing.assert_array_equal(
      cpu_matmul.untile_int8(jnp.asarray(tiled['token_embedder']['embedding_int8'])),
      rows_form['token_embedder']['embedding_int8'])
  tokens = jnp.asarray(np.random.default_rng(6).integers(2, 128, (3, 9)), jnp.int32)
  model = T5(TILED_CONFIG)
  encoded = model.apply(target, tokens, method=T5.encode)
  # Tokens of both tiles of the 128-token table, so that the lookup's gather counts.
  decoder_tokens = jnp.asarray([[0, 70, 99, 127], [0, 5, 64, 63], [0, 127, 1, 65]], jnp.int32)
  logits = {}
  for name, params in (('rows', rows_form), ('tiled', tiled)):
    for setting in (cpu_matmul.KERNEL, cpu_matmul.XLA):
      config = TILED_CONFIG.replace(cpu_matmul=setting)
      drafter = Int8Drafter(config)
      cache = drafter.init_state_from_target({'params': params}, tokens, encoded, 6)
      logits[name, setting], _ = SharedEncoderDraft(config, config.emb_dim).apply(
          {'params': params}, decoder_tokens, cache, method=SharedEncoderDraft.decode)
  # Each form as its XLA reference computes it; the tiled one quantizes the activations per
  # 32 inputs (cpu_matmul.activation_group), the [out, in] one per row: close, not equal.
  for form in ('rows', 'tiled'):
    np.testing.assert_allclose(logits[form, cpu_matmul.KERNEL], logits[form, cpu_matmul.XLA],
                               rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits['tiled', cpu_matmul.XLA], logits['rows', cpu_matmul.XLA],
                             rtol=0.05, atol=0.05)
  # Greedy speculative decoding with the tiled draft is the baseline.
  target_tokens = np.asarray(tokens)
  baseline = generate(target, target_tokens, config=TILED_CONFIG, max_decode_length=MAX_LEN)
  result = speculative_generate(target, {'params': tiled}, target_tokens,
                                target_config=TILED_CONFIG, drafter=Int8Drafter(TILED_CONFIG),
                                spec=SpeculativeConfig(gamma=3), max_decode_length=MAX_LEN)
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
