"""jaxspec's T5 against transformers' PyTorch T5, through the Hugging Face converter.

Both variants on tiny random models: T5.1.1 (gated GELU, own lm_head, unscaled
logits) and T5 1.0 (ReLU, logits through the embedding scaled by 1/sqrt(d_model)).
Checks the encoder, teacher-forced logits, k=1 incremental decoding, and k=3 / k=1
steps with rollbacks at a different position per row; then checkpoint loading.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torch  # The test extra installs both: a missing one fails rather than skips.
import transformers

from jaxspec.checkpoints import check_params, config_from_hf, load_hf_checkpoint, params_from_hf
from jaxspec.config import T5Config
from jaxspec.model import T5, rollback

SIZES = dict(vocab_size=96, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
             num_decoder_layers=3, dropout_rate=0.0)
VARIANTS = {
    't5_1_1': dict(feed_forward_proj='gated-gelu', tie_word_embeddings=False),
    't5_1_0': dict(feed_forward_proj='relu', tie_word_embeddings=True),
}
DECODER_LENGTH = 16
ATOL = 1e-4


def make_hf_model(variant):
  """A random transformers T5 whose norms, position biases and lm_head all matter."""
  torch.manual_seed(0)
  model = transformers.T5ForConditionalGeneration(
      transformers.T5Config(**SIZES, **VARIANTS[variant]))
  with torch.no_grad():
    for name, param in model.named_parameters():
      if 'layer_norm' in name:
        param.copy_(1.0 + 0.3 * torch.randn_like(param))
      elif 'relative_attention_bias' in name:
        param.copy_(torch.randn_like(param))
  if not VARIANTS[variant]['tie_word_embeddings']:
    # transformers >= 5 shares lm_head with the embedding; T5.1.1 has its own.
    model.lm_head.weight = torch.nn.Parameter(0.2 * torch.randn(SIZES['vocab_size'],
                                                                SIZES['d_model']))
  return model.eval()


def numpy_state_dict(model):
  return {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}


def make_inputs(vocab_size):
  """Encoder tokens [3, 8] of lengths 8, 5, 2 (EOS-terminated, 0-padded); decoder inputs [3, T]."""
  rng = np.random.default_rng(0)
  encoder_tokens = rng.integers(2, vocab_size, (3, 8)).astype(np.int32)
  for row, length in enumerate([8, 5, 2]):
    encoder_tokens[row, length - 1] = 1
    encoder_tokens[row, length:] = 0
  decoder_tokens = rng.integers(1, vocab_size, (3, DECODER_LENGTH)).astype(np.int32)
  decoder_tokens[:, 0] = 0  # The start token.
  return encoder_tokens, decoder_tokens


class Pair:
  """A HF model, its conversion, inputs, and the HF reference outputs."""

  def __init__(self, variant):
    self.hf_model = make_hf_model(variant)
    self.state_dict = numpy_state_dict(self.hf_model)
    self.config = config_from_hf(self.hf_model.config.to_dict())
    self.params = params_from_hf(self.state_dict, self.config)
    self.variables = {'params': jax.device_put(self.params)}
    self.encoder_tokens, self.decoder_tokens = make_inputs(self.config.vocab_size)
    with torch.no_grad():
      inputs = dict(input_ids=torch.tensor(self.encoder_tokens),
                    attention_mask=torch.tensor(self.encoder_tokens > 0))
      self.hf_encoded = self.hf_model.encoder(**inputs).last_hidden_state.numpy()
      self.hf_logits = self.hf_model(
          **inputs, decoder_input_ids=torch.tensor(self.decoder_tokens)).logits.numpy()


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def pair(request):
  return Pair(request.param)


@functools.partial(jax.jit, static_argnames=('config', 'max_length'))
def encode_and_init_cache(variables, encoder_tokens, config, max_length):
  model = T5(config)
  encoded = model.apply(variables, encoder_tokens, method=T5.encode)  # [b, s, e]
  return encoded, model.apply(variables, encoded, encoder_tokens, max_length,
                              method=T5.init_cache)


@functools.partial(jax.jit, static_argnames='config')
def decode(variables, decoder_tokens, cache, config):
  return T5(config).apply(variables, decoder_tokens, cache, method=T5.decode)


@functools.partial(jax.jit, static_argnames='config')
def full_logits(variables, encoder_tokens, decoder_tokens, config):
  return T5(config).apply(variables, encoder_tokens, decoder_tokens)


def test_config_from_transformers(pair):
  expected_1_1 = pair.hf_model.config.feed_forward_proj == 'gated-gelu'
  assert pair.config == T5Config(
      vocab_size=96, emb_dim=32, num_heads=4, head_dim=8, num_encoder_layers=2,
      num_decoder_layers=3, mlp_dim=48,
      mlp_activations=('gelu', 'linear') if expected_1_1 else ('relu',),
      logits_via_embedding=not expected_1_1)


def test_encoder_output(pair):
  encoded, _ = encode_and_init_cache(pair.variables, pair.encoder_tokens, pair.config,
                                     DECODER_LENGTH)
  real = pair.encoder_tokens > 0  # Padded positions differ by design (T5X masks queries too).
  np.testing.assert_allclose(np.asarray(encoded)[real], pair.hf_encoded[real], atol=ATOL,
                             rtol=0)


def test_full_logits(pair):
  logits = full_logits(pair.variables, pair.encoder_tokens, pair.decoder_tokens, pair.config)
  np.testing.assert_allclose(logits, pair.hf_logits, atol=ATOL, rtol=0)


def test_one_token_steps_equal_full_logits(pair):
  _, cache = encode_and_init_cache(pair.variables, pair.encoder_tokens, pair.config,
                                   DECODER_LENGTH)
  for position in range(DECODER_LENGTH):
    logits, cache = decode(pair.variables, pair.decoder_tokens[:, position:position + 1],
                           cache, pair.config)  # [b, 1, v]
    np.testing.assert_allclose(logits[:, 0], pair.hf_logits[:, position], atol=ATOL, rtol=0,
                               err_msg=f'position {position}')
  np.testing.assert_array_equal(cache.end_index, DECODER_LENGTH)


def rows_at(array, start, k):
  """array [b, T, ...], start [b] -> array[b, start[b]:start[b] + k] stacked: [b, k, ...]."""
  return np.stack([array[row, s:s + k] for row, s in enumerate(start)])


def test_multi_token_steps_with_rollbacks(pair):
  """k=3 drafts whose last two are wrong, rolled back; then k=1 and k=3 correct steps.

  Rows sit at different positions. The wrong tokens leave stale keys/values past
  each row's end index, which later queries must not see.
  """
  variables, config, tokens = pair.variables, pair.config, pair.decoder_tokens
  expected = pair.hf_logits  # [b, T, v]
  _, cache = encode_and_init_cache(variables, pair.encoder_tokens, config, DECODER_LENGTH)
  logits, cache = decode(variables, tokens[:, :3], cache, config)
  np.testing.assert_allclose(logits, expected[:, :3], atol=ATOL, rtol=0)
  start = np.array([3, 1, 2])
  cache = rollback(cache, start)
  for round_index in range(2):
    drafts = rows_at(tokens, start, 3)  # [b, 3]
    drafts[:, 1:] = (drafts[:, 1:] + 5) % config.vocab_size  # Wrong continuations.
    logits, cache = decode(variables, drafts, cache, config)
    np.testing.assert_allclose(logits[:, 0], rows_at(expected, start, 1)[:, 0], atol=ATOL,
                               rtol=0, err_msg=f'round {round_index}: first draft')
    np.testing.assert_array_equal(cache.end_index, start + 3)
    start = start + 1
    cache = rollback(cache, start)
    for k in (1, 3):
      logits, cache = decode(variables, rows_at(tokens, start, k), cache, config)
      np.testing.assert_allclose(logits, rows_at(expected, start, k), atol=ATOL, rtol=0,
                                 err_msg=f'round {round_index}: k={k} at {start}')
      start = start + k
      np.testing.assert_array_equal(cache.end_index, start)


def assert_same_params(actual, expected):
  assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
  for a, b in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_array_equal(a, b)


def test_load_safetensors_checkpoint(pair, tmp_path):
  pair.hf_model.save_pretrained(tmp_path)
  assert (tmp_path / 'model.safetensors').is_file()
  config, params = load_hf_checkpoint(tmp_path)
  assert config == pair.config
  assert_same_params(params, pair.params)


def test_load_sharded_safetensors_checkpoint(pair, tmp_path):
  pair.hf_model.save_pretrained(tmp_path, max_shard_size='60KB')
  assert (tmp_path / 'model.safetensors.index.json').is_file()
  config, params = load_hf_checkpoint(tmp_path)
  assert config == pair.config
  assert_same_params(params, pair.params)


def test_load_torch_bin_checkpoint_as_bfloat16(pair, tmp_path):
  torch.save(pair.hf_model.state_dict(), tmp_path / 'pytorch_model.bin')
  (tmp_path / 'config.json').write_text(json.dumps(pair.hf_model.config.to_dict()))
  config, params = load_hf_checkpoint(tmp_path)
  assert config == pair.config
  assert_same_params(params, pair.params)
  config, params = load_hf_checkpoint(tmp_path, param_dtype='bfloat16')
  assert config == pair.config.replace(param_dtype='bfloat16')
  assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype('bfloat16')}


def test_missing_checkpoint_files_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match='config.json'):
    load_hf_checkpoint(tmp_path)
  (tmp_path / 'config.json').write_text(json.dumps({'model_type': 't5', **SIZES}))
  with pytest.raises(FileNotFoundError, match=f'{tmp_path}: no weights.*model.safetensors'):
    load_hf_checkpoint(tmp_path)


def test_shape_mismatch_names_path_and_shapes(pair):
  wrong = pair.config.replace(mlp_dim=64)
  mlp_in = 'wi' if pair.config.mlp_activations == ('relu',) else 'wi_0'
  expected = (rf"'decoder/layers_0/mlp/{mlp_in}/kernel' \(from "
              rf"'decoder.block.0.layer.2.DenseReluDense.{mlp_in}.weight'\) has shape "
              r'\(32, 48\), the config expects \(32, 64\)')
  with pytest.raises(ValueError, match=expected):
    params_from_hf(pair.state_dict, wrong)


def test_missing_and_unexpected_hf_keys_are_named(pair):
  other_mlp = ('gelu', 'linear') if pair.config.mlp_activations == ('relu',) else ('relu',)
  missing = 'wi_0' if other_mlp == ('gelu', 'linear') else 'wi'
  with pytest.raises(ValueError, match=rf"lacks 'encoder.block.0.layer.1.DenseReluDense.{missing}"):
    params_from_hf(pair.state_dict, pair.config.replace(mlp_activations=other_mlp))
  with pytest.raises(ValueError, match=r"unexpected HF key 'decoder.block.2.layer.0.SelfAttention.k.weight'"):
    params_from_hf(pair.state_dict, pair.config.replace(num_decoder_layers=2))


def test_untied_lm_head_rejected_when_config_ties_it():
  state_dict = numpy_state_dict(make_hf_model('t5_1_0'))
  state_dict['lm_head.weight'] = state_dict['lm_head.weight'] + 1.0
  config = config_from_hf(transformers.T5Config(**SIZES, **VARIANTS['t5_1_0']).to_dict())
  with pytest.raises(ValueError, match="'lm_head.weight' differs from 'shared.weight'"):
    params_from_hf(state_dict, config)


def test_check_params_names_first_problem(pair):
  params = jax.tree_util.tree_map(np.asarray, pair.params)
  check_params(params, pair.config)
  check_params({'params': params}, pair.config)
  with pytest.raises(ValueError, match=r"'decoder/decoder_norm/scale' has shape \(33,\), "
                                       r'the config expects \(32,\)'):
    check_params({**params, 'decoder': {**params['decoder'], 'decoder_norm': {
        'scale': np.ones(33)}}}, pair.config)
  encoder = dict(params['encoder'])
  del encoder['encoder_norm']
  with pytest.raises(ValueError, match=r"missing 'encoder/encoder_norm/scale'"):
    check_params({**params, 'encoder': encoder}, pair.config)
  with pytest.raises(ValueError, match=r"unexpected 'encoder/extra/kernel'"):
    check_params({**params, 'encoder': {**params['encoder'], 'extra': {'kernel': np.ones(2)}}},
                 pair.config)


HF_1_1_SMALL = {  # google/t5-v1_1-small's config.json, as transformers 4 wrote it.
    'd_ff': 1024, 'd_kv': 64, 'd_model': 512, 'feed_forward_proj': 'gated-gelu',
    'layer_norm_epsilon': 1e-06, 'model_type': 't5', 'num_decoder_layers': 8, 'num_heads': 6,
    'num_layers': 8, 'relative_attention_num_buckets': 32, 'tie_word_embeddings': False,
    'vocab_size': 32128}
HF_T5_SMALL = {  # t5-small's config.json: no feed_forward_proj nor tie_word_embeddings.
    'd_ff': 2048, 'd_kv': 64, 'd_model': 512, 'layer_norm_epsilon': 1e-06, 'model_type': 't5',
    'num_heads': 8, 'num_layers': 6, 'relative_attention_num_buckets': 32, 'vocab_size': 32128}


def test_config_from_hub_configs_matches_named_configs():
  from jaxspec.config import get_config
  assert config_from_hf(HF_1_1_SMALL) == get_config('t5_1_1_small')
  assert config_from_hf(HF_T5_SMALL) == get_config('t5_small')
  assert config_from_hf(HF_T5_SMALL, dtype='bfloat16') == get_config('t5_small', dtype='bfloat16')


@pytest.mark.parametrize('field, value', [
    ('feed_forward_proj', 'gated-relu'), ('feed_forward_proj', 'gelu'),
    ('layer_norm_epsilon', 1e-5), ('model_type', 'umt5')])
def test_config_from_hf_rejects_unsupported_variants(field, value):
  with pytest.raises(ValueError, match=field):
    config_from_hf({**HF_1_1_SMALL, field: value})


def test_config_from_hf_names_missing_field():
  config = dict(HF_1_1_SMALL)
  del config['d_model']
  with pytest.raises(ValueError, match="lacks 'd_model'"):
    config_from_hf(config)


def hf_greedy(model, encoder_tokens, length):
  """transformers' greedy generate, start token dropped, padded to `length`."""
  with torch.no_grad():
    tokens = model.generate(
        input_ids=torch.tensor(encoder_tokens), attention_mask=torch.tensor(encoder_tokens > 0),
        do_sample=False, num_beams=1, max_new_tokens=length, min_length=0,
        decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
        # transformers sizes its cache by the encoder depth; this decoder is deeper.
        use_cache=False).numpy()[:, 1:]
  padded = np.zeros((len(tokens), length), np.int32)
  padded[:, :tokens.shape[1]] = tokens
  return padded


def output_embedding(model):
  return model.lm_head.weight if model.lm_head.weight is not None else model.shared.weight


def test_baseline_greedy_equals_transformers_generate(pair):
  """jaxspec's baseline decoder against transformers' greedy generate, same weights.

  The model is edited so the comparison covers varied tokens and an early EOS: the
  embedding is scaled down and the padding token's output row zeroed (random tiny
  models otherwise repeat their input token or emit 0 forever), then the output rows of EOS and of a token row 0 emits mid-sequence are swapped,
  so that row ends early while the others run on.
  """
  import copy
  from jaxspec.decoding.baseline import generate
  length = 20
  model = copy.deepcopy(pair.hf_model)
  with torch.no_grad():
    model.shared.weight *= 0.2
    weights = output_embedding(model)
    weights[0] = 0.0
    first = hf_greedy(model, pair.encoder_tokens, length)[0]
    token = next(t for i, t in enumerate(first) if i >= 4 and t > 1 and t not in first[:i])
    weights[[1, token]] = weights[[token, 1]].clone()
  encoder_tokens = pair.encoder_tokens.copy()
  if weights is model.shared.weight:
    # Tied: the swap moved input embeddings too; swap the ids in the inputs back.
    encoder_tokens = np.select([encoder_tokens == 1, encoder_tokens == token],
                               [token, 1], encoder_tokens).astype(np.int32)
  expected = hf_greedy(model, encoder_tokens, length)
  assert (expected[0] == 1).any() and not (expected == 1).all(axis=None)
  assert (expected[:, 0] != 0).all()
  config = config_from_hf(model.config.to_dict())
  variables = {'params': params_from_hf(numpy_state_dict(model), config)}
  out = generate(variables, jnp.asarray(encoder_tokens), config=config,
                 max_decode_length=length)
  np.testing.assert_array_equal(np.asarray(out.tokens), expected)
