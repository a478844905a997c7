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
sys.path.insert(0, os.path.join(REPO, 'scripts'))

import gin_flags  # noqa: E402
import jaxspec.configurables  # noqa: E402,F401  (registers the dataclasses with gin)
from jaxspec.checkpoints.t5x import load_t5x_checkpoint  # noqa: E402

TASKS = {'ende': 'bleu', 'docsum': 'rouge1'}
MODELS = {'target': 9.92e6, 'draft_small': 0.81e6, 'draft_base': 2.80e6}  # parameters


@pytest.fixture(autouse=True)
def _unlocked_gin():
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.mark.parametrize('task', sorted(TASKS))
@pytest.mark.parametrize('model', sorted(MODELS))
def test_shipped_checkpoint_loads_under_its_model_definition(task, model):
  gin_flags.parse([f'--gin_file=gin/models/local_{model}.gin'])
  config = gin.query_parameter('%MODEL').scoped_configurable_fn()
  params = load_t5x_checkpoint(os.path.join(REPO, 'checkpoints', task, model), config)
  count = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))
  assert round(count / 1e4) == round(MODELS[model] / 1e4), count


@pytest.mark.parametrize('task', sorted(TASKS))
def test_main_job_on_the_shipped_pair(task, tmp_path):
  # As users run it: the launcher in a process of its own (in the suite's long-lived
  # process, XLA:CPU once crashed compiling this job after hundreds of other programs).
  subprocess.run([sys.executable, 'scripts/infer.py', f'--gin_file=configs/infer/{task}_local.gin',
                  '--gin.infer.num_examples=3', f"--gin.infer.output_dir='{tmp_path}'"],
                 cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=900)
  summary = json.loads((tmp_path / 'summary.json').read_text())
  assert summary['examples'] == summary['identical_outputs'] == 3
  metric = TASKS[task]
  assert summary[f'baseline_{metric}'] == summary[f'speculative_{metric}']
  assert summary['tokens_per_target_call'] > 1.0  # The draft's tokens were accepted.
