"""The step-cost harness (jaxspec/step_costs.py, scripts/step_costs.py) on a tiny target.

No timing is asserted: the tests check what is measured and written, and XLA's cost
analysis against the FLOPs counted by hand from the architecture.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxspec import step_costs
from jaxspec.config import get_config
from jaxspec.model import init_params, kernel_layout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'scripts'))
import step_costs as step_costs_script  # noqa: E402  (scripts/step_costs.py)

SETUP = step_costs.StepCostSetup(source_length=6, cache_position=3, cache_length=12,
                                 steps_per_call=2, repeats=2)


def _matmul_flops(config, k):
  """FLOPs of the decoder's projections and logits for k new positions, by hand."""
  e, joined, f, v = (config.emb_dim, config.num_heads * config.head_dim, config.mlp_dim,
                     config.vocab_size)
  per_layer = 4 * e * joined + 2 * e * joined + 3 * e * f  # self q,k,v,o; cross q,o; MLP
  return 2 * k * (config.num_decoder_layers * per_layer + e * v)


@pytest.mark.parametrize('variant', list(step_costs.VARIANTS))
def test_cost_analysis_counts_the_decoder_matmuls(variant):
  params, config = step_costs.variant(
      {'params': init_params(get_config('test_tiny_1_1'), jax.random.PRNGKey(0))['params']},
      get_config('test_tiny_1_1'), variant)
  cache = step_costs._empty_cache(params, config, SETUP)
  for k in (1, 4):
    cost = step_costs.step_cost_analysis(params, cache, jnp.ones((1, k), jnp.int32), config,
                                         SETUP.cache_position)
    # Matmuls dominate; attention, norms and softmax add a little on top.
    assert _matmul_flops(config, k) <= cost['flops'] <= 2 * _matmul_flops(config, k)
    assert cost['bytes'] > 4 * _matmul_flops(config, 1) / 2  # Every weight is read.


def test_variants_name_a_layout_and_a_cpu_matmul():
  params = {'params': init_params(get_config('test_tiny_1_1'), jax.random.PRNGKey(0))['params']}
  for name, (layout, cpu_matmul) in step_costs.VARIANTS.items():
    variant_params, config = step_costs.variant(params, get_config('test_tiny_1_1'), name)
    assert config.cpu_matmul == cpu_matmul
    assert kernel_layout.has_transposed_kernels(variant_params) == (
        layout == kernel_layout.TRANSPOSED)
  assert set(step_costs.VARIANTS) == {'t5x', 'transposed', 'kernel'}


def test_measure_step_costs_reports_every_variant_and_position():
  costs = step_costs.measure_step_costs(get_config('test_tiny_1_1'), [3, 2], setup=SETUP)
  assert set(costs.ratio) == set(step_costs.VARIANTS)
  for variant in costs.ratio:
    assert sorted(costs.ratio[variant]) == [1, 2, 3]
    assert costs.ratio[variant][1] == 1.0
    assert all(seconds > 0 for seconds in costs.step_seconds[variant].values())


def test_script_writes_json_markdown_and_plot(tmp_path):
  out = tmp_path / 'costs'
  step_costs_script.main(['--targets=test_tiny_1_1', '--drafts=test_tiny_1_0',
                          '--positions=1,2', '--repeats=2', '--steps_per_call=2',
                          f'--out={out}'])
  results = json.loads((out / 'step_costs.json').read_text())
  target = results['targets']['test_tiny_1_1']
  assert set(target['variants']) == {'t5x', 'transposed', 'kernel'}
  assert set(target['variants']['kernel']) == {'1', '2'}
  assert set(results['drafts']['test_tiny_1_0']['proposal_ms']) == {'t5x', 'transposed',
                                                                     'kernel'}
  table = (out / 'step_costs.md').read_text()
  assert '| test_tiny_1_1 |' in table and '| test_tiny_1_0 |' in table
  assert (out / 'v_of_k.png').read_bytes()[:4] == b'\x89PNG'
