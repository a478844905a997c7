"""The accelerator decode layout (jaxspec.model.accelerator.layout), checked on the CPU
through XLA's products (what a GPU or TPU runs).

- Conversion: exactly the decoder's self-attention q/k/v and gated MLP wi_0/wi_1 kernels
  are stacked (encoder and cross-attention untouched), with their logical axes; every
  other layout unstacks first, so writers, int8 drafts and check_params see T5X's
  kernels; the round trip is exact; GPUs and TPUs decode in it.
- The model computes the same function in it: cached decode steps of 1 and several
  positions equal the unfused model's up to float32 rounding (both T5 variants).
- Exactness where it matters: with fixed-width steps, in bfloat16, greedy speculative
  decoding of the shipped pair in the fused layout is its baseline token for token.
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
from jaxspec.model.accelerator import layout as accelerator_layout
from jaxspec.model.cpu import layout as kernel_layout

WIDTH = 4  # gamma 3


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


def test_accelerators_decode_in_the_fused_layout_and_the_cpu_in_the_transposed():
  variables = _variables('test_tiny_1_1')
  for platform in ('gpu', 'tpu'):
    assert kernel_layout.decode_layout(platform) == kernel_layout.FUSED
    assert accelerator_layout.has_fused_kernels(
        kernel_layout.for_decoding(variables, platform))
  assert kernel_layout.decode_layout('cpu') == kernel_layout.TRANSPOSED
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


@pytest.mark.parametrize('name, num_steps', [('test_tiny_1_1', 3), ('test_tiny_1_0', 1)])
def test_decode_steps_equal_the_unfused_models(name, num_steps):
  """float32 through XLA's products: the unfused T5X layout is the reference; the fused
  layout differs from it by float32 rounding at most."""
  config = get_config(name, cpu_matmul='xla')
  variables = {'params': _variables(name)['params']}
  rng = np.random.default_rng(0)
  encoder_tokens = jnp.asarray(rng.integers(2, 64, (2, 7)), jnp.int32)
  decoder_tokens = jnp.asarray(rng.integers(2, 64, (2, 6 if num_steps > 1 else 4)), jnp.int32)
  reference = _cached_steps(variables, encoder_tokens, decoder_tokens, config=config,
                            num_steps=num_steps)
  fused = _cached_steps(kernel_layout.fused_kernels(variables), encoder_tokens,
                        decoder_tokens, config=config, num_steps=num_steps)
  np.testing.assert_allclose(fused, reference, rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(reference)).max() > 0.1  # logits of substance


# ----------------------------------------------------------------------------------
# Exactness with fixed-width steps, in bfloat16.


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
