"""The shipped pairs (checkpoints/): each checkpoint loads under its gin model
definition with the parameter count checkpoints/README.md states, and each main job
(configs/infer/*_local.gin) decodes test examples with them, the speculative output
identical to the baseline's at temperature 0 and the task metric equal."""

import json
import os
import subprocess
import sys

import gin
import jax
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxspec.launch import gin_flags
import jaxspec.configurables  # noqa: E402,F401  (registers the dataclasses with gin)
from jaxspec.checkpoints.t5x import load_t5x_checkpoint  # noqa: E402
from jaxspec import inference  # noqa: E402
from jaxspec.config import get_config  # noqa: E402
from jaxspec.decoding.drafters import Int8Drafter, SharedEncoderDrafter  # noqa: E402

# Main job (configs/infer/<name>.gin) -> its metric: the docsum target with its int8
# draft (ROUGE) and the 9.9M EnDe pair with its trained draft (a T5 draft of its own).
# The default (ende54m_int8.gin: the 54M target with its int8 draft) runs as README's
# Quickstart, greedy and sampled, from the wheel (tests/test_readme.py), with the same
# checks. configs/infer/docsum_local.gin (the docsum target with its trained draft: the
# same routes) and ende54m_local.gin are parsed by tests/test_gin_configs.py, their
# checkpoints loaded below.
MAIN_JOBS = {'ende_local': 'bleu', 'docsum_int8': 'rouge1'}
# Shipped checkpoint (checkpoints/<path>) -> its gin model (gin/models/) and parameters.
CHECKPOINTS = {
    f'{pair}/{model}': (f'local_{model}', count)
    for pair in ('ende', 'docsum', 'ende54m')
    for model, count in (('target', 9.92e6), ('draft_small', 0.81e6), ('draft_base', 2.80e6))
} | {
    'ende54m/target': ('local_target_54m', 54.44e6),
}


@pytest.fixture(autouse=True)
def _unlocked_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _parameter_count(params) -> int:
  return sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize('path', sorted(CHECKPOINTS))
def test_shipped_checkpoint_loads_under_its_model_definition(path):
  model, expected = CHECKPOINTS[path]
  gin_flags.parse([f'--gin_file=gin/models/{model}.gin'])
  config = gin.query_parameter('%MODEL').scoped_configurable_fn()
  params = load_t5x_checkpoint(os.path.join(REPO, 'checkpoints', path), config)
  assert round(_parameter_count(params) / 1e4) == round(expected / 1e4), _parameter_count(params)


def test_fields_added_later_are_left_out_of_settings_at_their_default():
  # A drafter field added later must not change the settings recorded by earlier runs
  # (users' output directories), or the launcher refuses to resume them
  # (inference.SettingsChanged): the drafters describe themselves as before.
  config = get_config('test_tiny_1_1')
  plain = inference.describe(SharedEncoderDrafter(config, config.emb_dim))
  assert set(plain) == {'class', 'config', 'encoder_dim'}
  assert set(inference.describe(Int8Drafter(config))) == {'class', 'config', 'encoder_dim'}
  assert inference.describe(SharedEncoderDrafter(config, config.emb_dim, weights='int8'))[
      'weights'] == 'int8'
  assert 'weights' not in inference.describe(Int8Drafter(config))
  with pytest.raises(ValueError, match="an int8 draft has int8 weights"):
    Int8Drafter(config, weights='float32')


# The launcher's main() on each main job in turn, as `python scripts/infer.py
# --gin_file=configs/infer/<name>.gin ...` runs it, in one process of the jobs' own (in
# the suite's long-lived process, XLA:CPU once crashed compiling a job after hundreds of
# other programs): the interpreter, jax and the launcher start once, not once a job. A
# job that raises leaves its traceback in <output dir>/error.txt; the others still run.
_RUN_MAIN_JOBS = """
import os, sys, traceback
import gin
from jaxspec.launch import infer
for name, output_dir in zip(sys.argv[1::2], sys.argv[2::2]):
  gin.clear_config()
  try:
    infer.main([f'--gin_file=configs/infer/{name}.gin', '--gin.infer.num_examples=3',
                f"--gin.infer.output_dir='{output_dir}'"])
  except Exception:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, 'error.txt'), 'w') as f:
      f.write(traceback.format_exc())
"""


@pytest.fixture(scope='module')
def main_job_outputs(tmp_path_factory):
  """name -> the output directory of its main job (3 test examples)."""
  outputs = {name: tmp_path_factory.mktemp(name) for name in sorted(MAIN_JOBS)}
  subprocess.run([sys.executable, '-c', _RUN_MAIN_JOBS]
                 + [str(a) for item in outputs.items() for a in item],
                 cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=900)
  return outputs


@pytest.mark.parametrize('name', sorted(MAIN_JOBS))
def test_main_job_on_the_shipped_pair(name, main_job_outputs):
  output_dir = main_job_outputs[name]
  assert not (output_dir / 'error.txt').exists(), (output_dir / 'error.txt').read_text()
  summary = json.loads((output_dir / 'summary.json').read_text())
  assert summary['examples'] == summary['identical_outputs'] == 3
  metric = MAIN_JOBS[name]
  assert summary[f'baseline_{metric}'] == summary[f'speculative_{metric}']
  assert summary['tokens_per_target_call'] > 1.0  # The draft's tokens were accepted.
