"""jaxspec.model.sharding: activation constraints by logical axis names (one device;
tests/test_partitioning.py checks them on 8 simulated devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import partitioning
from jaxspec.config import get_config
from jaxspec.model import T5, init_params
from jaxspec.model import sharding

RULES = partitioning.STANDARD_LOGICAL_AXIS_RULES


def _one_device_mesh():
  return partitioning.make_mesh(1, num_devices=1)


def _hlo_sharding_constraints(fn, *args) -> int:
  return jax.jit(fn).lower(*args).as_text().count('sharding_constraint')


def test_constrain_is_the_identity_outside_a_block():
  x = jnp.ones((2, 3, 4))
  assert sharding.constrain(x, ('batch', 'length', 'embed')) is x
  assert _hlo_sharding_constraints(
      lambda x: sharding.constrain(x, ('batch', 'length', 'embed')), x) == 0


def test_constrain_pins_activations_inside_a_block_by_role():
  x = jnp.ones((2, 3, 4))
  with sharding.activation_sharding(_one_device_mesh(), {sharding.TARGET: RULES}):
    assert _hlo_sharding_constraints(
        lambda x: sharding.constrain(x, ('batch', 'length', 'embed')), x) == 1
    # A role without rules in the block is left alone.
    assert _hlo_sharding_constraints(
        lambda x: sharding.constrain(x, ('batch', 'length', 'embed'), sharding.DRAFT), x) == 0
  assert sharding._RULES_BY_ROLE.get() == {}  # pylint: disable=protected-access
  assert jax.sharding.get_abstract_mesh().empty


def test_constrain_names_a_wrong_number_of_axes():
  with sharding.activation_sharding(_one_device_mesh(), {sharding.TARGET: RULES}):
    with pytest.raises(ValueError, match=r"2 logical axes \('batch', 'embed'\).*\(2, 3, 4\)"):
      sharding.constrain(jnp.ones((2, 3, 4)), ('batch', 'embed'))


def test_model_under_a_block_computes_the_same_logits():
  config = get_config('test_tiny_1_1')
  params = init_params(config, jax.random.PRNGKey(0))
  encoder_tokens = jnp.array([[5, 6, 7, 1, 0]], jnp.int32)
  decoder_tokens = jnp.array([[0, 9, 4]], jnp.int32)
  forward = lambda p, e, d: T5(config).apply(p, e, d)  # noqa: E731
  plain = jax.jit(forward)(params, encoder_tokens, decoder_tokens)
  mesh = _one_device_mesh()
  with sharding.activation_sharding(mesh, {sharding.TARGET: RULES}):
    # Embeddings, attention (q, k, v, joined output, residual), MLP, logits, cache.
    assert _hlo_sharding_constraints(forward, params, encoder_tokens, decoder_tokens) > 10
    constrained = jax.jit(forward)(params, encoder_tokens, decoder_tokens)
  np.testing.assert_allclose(np.asarray(constrained), np.asarray(plain), rtol=1e-6, atol=1e-6)
