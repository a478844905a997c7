"""The accelerator decode layout (jaxspec.model.accelerator.layout) and the attention
through jax.nn.dot_product_attention (jaxspec.model.accelerator.attention), checked on
the CPU through XLA's products (what a GPU or TPU runs).

- Conversion: exactly the decoder's self-attention q/k/v and gated MLP wi_0/wi_1 kernels
  are stacked (encoder and cross-attention untouched), with their logical axes; every
  other layout unstacks first, so writers, int8 drafts and check_params see T5X's
  kernels; the round trip is exact; GPUs and TPUs decode in it.
- The model computes the same function in it: cached decode steps of 1 and several
  positions equal the unfused model's up to float32 rounding (both T5 variants), and so
  does the attention through jax.nn.dot_product_attention against jaxspec's einsums.
- Exactness where it matters: with fixed-width steps, in bfloat16, steps of any width
  with rollbacks give the one-position steps' logits bit for bit in the fused layout
  with jax.nn.dot_product_attention, and greedy speculative decoding of the shipped pair
  in the fused layout is its baseline token for token.
"""

import functools

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import pairs
from jaxspec.checkpoints import check_params
from jaxspec.config import get_config
from jaxspec.data import corpora
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import Int8Drafter, T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import T5, init_params
from jaxspec.model.accelerator import attention as accelerator_attention
from jaxspec.model.accelerator import layout as accelerator_layout
from jaxspec.model.cache import rollback
from jaxspec.model.cpu import attention as cpu_attention
from jaxspec.model.cpu import layout as kernel_layout

WIDTH = 4  # gamma 3
DOT_PRODUCT_ATTENTION = 'dot_product_attention'
BFLOAT16_XLA = dict(dtype='bfloat16', param_dtype='bfloat16', cpu_matmul='xla')


@functools.cache
def _variables(name):
  return init_params(get_config(name), jax.random.PRNGKey(3))


def _flat(tree):
  return flax.traverse_util.flatten_dict(tree, sep='/')


# ----------------------------------------------------------------------------------
# Conversion.


def test_fusing_stacks_exactly_the_decoders_self_attention_and_mlp_inputs():
  variables = _variables('test_tiny_1_1')
  fused = kernel_layout.fused_kernels(variables)
  before, after = _flat(variables['params']), _flat(fused['params'])
  layers = get_config('test_tiny_1_1').num_decoder_layers
  for i in range(layers):
    layer = f'decoder/layers_{i}'
    np.testing.assert_array_equal(
        after[f'{layer}/self_attention/qkv_kernel'],
        np.stack([before[f'{layer}/self_attention/{p}/kernel']
                  for p in ('query', 'key', 'value')], axis=1))  # [e, 3, h*d]
    np.testing.assert_array_equal(
        after[f'{layer}/mlp/wi_kernel'],
        np.stack([before[f'{layer}/mlp/wi_{j}/kernel'] for j in (0, 1)], axis=1))  # [e, 2, f]
  stacked = {path for path in before if path.startswith('decoder/layers_') and (
      '/self_attention/' in path and '/out/' not in path or '/mlp/wi_' in path)}
  assert len(stacked) == 5 * layers
  # Everything else (the encoder, the cross-attention, the norms) as it was.
  assert set(after) == (set(before) - stacked) | {
      f'decoder/layers_{i}/{leaf}' for i in range(layers)
      for leaf in ('self_attention/qkv_kernel', 'mlp/wi_kernel')}
  for path in set(before) - stacked:
    np.testing.assert_array_equal(after[path], before[path])
  axes = _flat(fused['params_axes'])
  assert axes['decoder/layers_0/self_attention/qkv_kernel_axes'].names == (
      'embed', 'stack', 'joined_kv')
  assert axes['decoder/layers_0/mlp/wi_kernel_axes'].names == ('embed', 'stack', 'mlp')
  assert 'decoder/layers_0/mlp/wi_0/kernel_axes' not in axes
  assert accelerator_layout.has_fused_kernels(fused)
  assert not accelerator_layout.has_fused_kernels(variables)


def test_every_layout_converts_to_every_other_exactly():
  variables = _variables('test_tiny_1_0')  # T5 1.0: the MLP's one wi stays as it is
  fused = kernel_layout.to_layout(variables, kernel_layout.FUSED)
  assert 'wi' in fused['params']['decoder']['layers_0']['mlp']
  assert 'qkv_kernel' in fused['params']['decoder']['layers_0']['self_attention']
  for layout in kernel_layout.LAYOUTS:
    there = kernel_layout.to_layout(fused, layout)
    again = kernel_layout.to_layout(there, layout)  # idempotent
    jax.tree.map(np.testing.assert_array_equal, again['params'], there['params'])
    back = kernel_layout.t5x_kernels(there)
    jax.tree.map(np.testing.assert_array_equal, back['params'], variables['params'])
    assert _flat(back['params_axes']).keys() == _flat(variables['params_axes']).keys()
  # Transposed straight from fused: every kernel kernel_t, none stacked.
  transposed = kernel_layout.transposed_kernels(fused)
  assert not accelerator_layout.has_fused_kernels(transposed)
  jax.tree.map(np.testing.assert_array_equal, transposed['params'],
               kernel_layout.transposed_kernels(variables)['params'])


def test_shape_only_trees_convert_too():
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        _variables('test_tiny_1_1')['params'])
  fused = accelerator_layout.fused_kernels(shapes)
  qkv = fused['decoder']['layers_0']['self_attention']['qkv_kernel']
  assert isinstance(qkv, jax.ShapeDtypeStruct) and qkv.shape == (32, 3, 32)
  back = accelerator_layout.unfused_kernels(fused)
  assert jax.tree.map(lambda x: x.shape, back) == jax.tree.map(lambda x: x.shape, shapes)


def test_accelerators_decode_in_the_fused_layout_and_the_cpu_in_its_own():
  variables = _variables('test_tiny_1_1')
  for platform in ('gpu', 'tpu'):
    assert kernel_layout.decode_layout(platform) == kernel_layout.FUSED
    assert accelerator_layout.has_fused_kernels(
        kernel_layout.for_decoding(variables, platform))
  assert kernel_layout.decode_layout('cpu') in (kernel_layout.TRANSPOSED, kernel_layout.TILED)
  with pytest.raises(ValueError, match='kernel layout must be one of'):
    kernel_layout.to_layout(variables, 'columns')


def test_checks_writers_and_int8_drafts_see_t5x_kernels():
  config = get_config('test_tiny_1_1')
  variables = _variables('test_tiny_1_1')
  fused = kernel_layout.fused_kernels(variables)
  check_params(fused['params'], config)
  wrong = _flat(fused['params'])
  wrong['decoder/layers_0/mlp/wi_kernel'] = wrong['decoder/layers_0/mlp/wi_kernel'][:, :, :8]
  with pytest.raises(ValueError, match=r"decoder/layers_0/mlp/wi_0/kernel'.*\(32, 8\)"):
    check_params(flax.traverse_util.unflatten_dict(wrong, sep='/'), config)
  # The int8 self-draft is made from the same matrices whatever the target's layout.
  from_fused = Int8Drafter.draft_params(fused)
  from_t5x = Int8Drafter.draft_params(variables)
  jax.tree.map(np.testing.assert_array_equal, from_fused, from_t5x)


# ----------------------------------------------------------------------------------
# The same function.


@functools.partial(jax.jit, static_argnames=('config', 'num_steps'))
def _cached_steps(params, encoder_tokens, decoder_tokens, *, config, num_steps):
  """The logits [b, t, v] of decoder_tokens [b, t] from cached steps of num_steps."""
  model = T5(config)
  encoded = model.apply(params, encoder_tokens, method=T5.encode)
  cache = model.apply(params, encoded, encoder_tokens, decoder_tokens.shape[1],
                      method=T5.init_cache)
  stepped = []
  for start in range(0, decoder_tokens.shape[1], num_steps):
    logits, cache = model.apply(params, decoder_tokens[:, start:start + num_steps], cache,
                                method=T5.decode)
    stepped.append(logits)
  return jnp.concatenate(stepped, axis=1)


@pytest.mark.parametrize('name, num_steps, decode_attention', [
    ('test_tiny_1_1', 3, 'einsum'), ('test_tiny_1_0', 1, 'einsum'),
    ('test_tiny_1_1', 1, DOT_PRODUCT_ATTENTION)])
def test_decode_steps_equal_the_unfused_models(name, num_steps, decode_attention):
  """float32 through XLA's products: the unfused T5X layout with jaxspec's einsums is
  the reference; the fused layout (and the attention through
  jax.nn.dot_product_attention) differ from it by float32 rounding at most."""
  config = get_config(name, cpu_matmul='xla')
  variables = {'params': _variables(name)['params']}
  rng = np.random.default_rng(0)
  encoder_tokens = jnp.asarray(rng.integers(2, 64, (2, 7)), jnp.int32)
  decoder_tokens = jnp.asarray(rng.integers(2, 64, (2, 6 if num_steps > 1 else 4)), jnp.int32)
  reference = _cached_steps(variables, encoder_tokens, decoder_tokens, config=config,
                            num_steps=num_steps)
  fused = _cached_steps(kernel_layout.fused_kernels(variables), encoder_tokens,
                        decoder_tokens, config=config.replace(decode_attention=decode_attention),
                        num_steps=num_steps)
  np.testing.assert_allclose(fused, reference, rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(reference)).max() > 0.1  # logits of substance


@pytest.mark.parametrize('keys_in_slots', [False, True])
def test_dot_product_attention_is_jaxspecs_attention(keys_in_slots):
  """A step's self-attention and its cache write (rows at different slots, one whose
  last key falls past the buffer), and a cross-attention, against jaxspec's einsums."""
  rng = np.random.default_rng(int(keys_in_slots))
  b, t, h, d, length = 2, 3, 2, 8, 12
  query, new_keys, new_values = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
                                 for _ in range(3))
  keys, values = (jnp.asarray(rng.standard_normal((b, h, d, length)), jnp.float32)
                  for _ in range(2))
  starts = jnp.asarray([3, 10])
  positions = starts[:, None] + jnp.arange(t)[None, :]  # [b, t]
  relative = jnp.asarray(rng.standard_normal((b, h, t, length)), jnp.float32)
  bias = relative + jnp.where(jnp.arange(length)[None, None, :] <= positions[:, :, None],
                              0.0, -1e10)[:, None]  # [b, h, t, L]
  expected = cpu_attention.xla_attend_and_write(query, new_keys, new_values, keys, values,
                                                bias, starts, keys_in_slots)
  actual = accelerator_attention.attend_and_write(query, new_keys, new_values, keys, values,
                                                  bias, starts, keys_in_slots)
  np.testing.assert_allclose(actual[0], expected[0], rtol=1e-5, atol=1e-5)
  for written, reference in zip(actual[1:], expected[1:]):
    np.testing.assert_array_equal(written, reference)
  cross_bias = bias[:, :1]  # [b, 1, t, s]
  np.testing.assert_allclose(
      accelerator_attention.cached_attention(query, keys, values, cross_bias),
      cpu_attention.xla_cached_attention(query, keys, values, cross_bias),
      rtol=1e-5, atol=1e-5)


def test_cudnn_where_its_fused_kernel_takes_the_operands():
  implementation = accelerator_attention.implementation
  assert implementation(jnp.bfloat16, 64, nvidia_gpu=True) == 'cudnn'
  assert implementation(jnp.float16, 128, nvidia_gpu=True) == 'cudnn'
  assert implementation(jnp.float32, 64, nvidia_gpu=True) is None  # JAX's choice
  assert implementation(jnp.bfloat16, 160, nvidia_gpu=True) is None
  assert implementation(jnp.bfloat16, 64, nvidia_gpu=False) is None
  assert implementation(jnp.bfloat16, 64) is None  # this CPU
  with pytest.raises(ValueError, match='decode_attention must be one of'):
    get_config('test_tiny_1_1', decode_attention='flash')


# ----------------------------------------------------------------------------------
# Exactness with fixed-width steps, in bfloat16.

# The shipped target's shapes, fewer layers: wide enough products that XLA rounds them
# differently for different numbers of rows (tests/test_decode_positions.py).
CONFIG = get_config('local_target', num_encoder_layers=1, num_decoder_layers=2,
                    **BFLOAT16_XLA)


def _step_logits(config, params, sequence, widths, junk=0):
  """Logits [n, v] of sequence [n] (one row) decoded in steps that keep `widths` tokens,
  each followed by `junk` junk tokens and rolled back past them."""
  model = T5(config)
  encoder_tokens = jnp.asarray(np.random.default_rng(1).integers(2, config.vocab_size, (1, 7)),
                               jnp.int32)
  cache = jax.jit(lambda tokens: model.apply(
      params, model.apply(params, tokens, method=T5.encode), tokens, 16,
      method=T5.init_cache))(encoder_tokens)
  decode = jax.jit(lambda tokens, cache: model.apply(params, tokens, cache, method=T5.decode))
  kept, start = [], 0
  for width in widths:
    tokens = jnp.concatenate([sequence[start:start + width], jnp.full((junk,), 7, jnp.int32)])
    logits, cache = decode(tokens[None, :], cache)  # [1, width + junk, v]
    kept += [logits[0, j] for j in range(width)]
    start += width
    cache = rollback(cache, jnp.asarray([start]))
  return np.stack(kept)


def test_fixed_width_steps_round_as_one_position_steps_with_dot_product_attention():
  """The fused layout's products, and the attention through jax.nn.dot_product_attention
  over every key at its slot: a row of a step computed alike whatever the step's width
  (the greedy identity below covers the fused layout with jaxspec's einsums)."""
  config = CONFIG.replace(decode_positions=WIDTH, decode_attention=DOT_PRODUCT_ATTENTION)
  params = kernel_layout.fused_kernels(init_params(CONFIG, jax.random.PRNGKey(0)))
  sequence = jnp.asarray(np.random.default_rng(3).integers(2, CONFIG.vocab_size, (8,)),
                         jnp.int32)
  np.testing.assert_array_equal(_step_logits(config, params, sequence, [3, 3, 1, 1], junk=1),
                                _step_logits(config, params, sequence, [1] * 8))


@pytest.fixture(scope='module')
def shipped_fused():
  """The shipped pair in bfloat16, both models in the fused layout, 24 inputs."""
  pair = pairs.load('ende_local', 'small', dtype='bfloat16')
  examples = corpora.load_split(pair.task, 'validation')[:24]
  inputs = pair.encode([example['inputs'] for example in examples])
  return (pair, kernel_layout.fused_kernels(pair.target_params),
          kernel_layout.fused_kernels(pair.draft_params), inputs)


def test_greedy_speculative_is_the_baseline_in_the_fused_layout(shipped_fused):
  """What a GPU runs by default: both models fused, fixed-width target steps."""
  pair, target_params, draft_params, inputs = shipped_fused
  target_config = pair.target_config.replace(cpu_matmul='xla', decode_positions=WIDTH)
  drafter = T5Drafter(pair.draft_config.replace(cpu_matmul='xla'))
  baseline, speculative = [], []
  for row in range(len(inputs)):
    rows = inputs[row:row + 1]
    baseline.append(np.asarray(generate(
        target_params, rows, config=target_config,
        max_decode_length=pair.max_decode_length).tokens))
    speculative.append(np.asarray(speculative_generate(
        target_params, draft_params, rows, target_config=target_config, drafter=drafter,
        spec=SpeculativeConfig(gamma=WIDTH - 1),
        max_decode_length=pair.max_decode_length).output.tokens))
  np.testing.assert_array_equal(np.concatenate(speculative), np.concatenate(baseline))
