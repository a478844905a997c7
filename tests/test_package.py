"""Package-level properties: a TensorFlow-free decoding core, dtypes from config, and the
wheel as installed (kernel sources, gin files, the launchers from any directory)."""

import functools
import importlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _wheel import venv_environment

from jaxspec import get_config
from jaxspec.model import T5, init_params
from jaxspec.model.cpu import matmul as cpu_matmul


def test_decoding_core_imports_without_tensorflow():
  code = ('import sys\n'
          'import jaxspec.model, jaxspec.sampling, jaxspec.decoding.baseline\n'
          'import jaxspec.decoding.speculative, jaxspec.decoding.drafters\n'
          'import jaxspec.checkpoints, jaxspec.checkpoints.t5x, jaxspec.measure.analysis\n'
          'bad = [m for m in ("tensorflow", "seqio", "torch", "t5x") if m in sys.modules]\n'
          'assert not bad, bad\n')
  subprocess.run([sys.executable, '-c', code], check=True)


# Each a jitted program: the dtypes are the traced ones, as when the calls run one
# operation at a time (which compiled ~250 small programs here).
@functools.partial(jax.jit, static_argnums=0)
def _encode_and_step(config, variables, encoder_tokens):
  """The encoder output, the decoder cache and the first decode step's logits."""
  model = T5(config)
  encoded = model.apply(variables, encoder_tokens, method=T5.encode)
  cache = model.apply(variables, encoded, encoder_tokens, 4, method=T5.init_cache)
  logits, _ = model.apply(variables, jnp.zeros((1, 1), jnp.int32), cache, method=T5.decode)
  return encoded, cache, logits


@functools.partial(jax.jit, static_argnums=0)
def _float32_forward(config, variables, encoder_tokens, decoder_tokens):
  """The logits of config's model in float32 on the variables cast to float32."""
  f32_config = config.replace(dtype='float32', param_dtype='float32')
  f32_variables = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), variables)
  return T5(f32_config).apply(f32_variables, encoder_tokens, decoder_tokens)


def test_compute_and_parameter_dtypes_come_from_config():
  config = get_config('test_tiny_1_1', dtype='bfloat16', param_dtype='bfloat16')
  variables = jax.jit(init_params, static_argnums=0)(config, jax.random.PRNGKey(0))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(variables['params']))
  encoder_tokens = jnp.array([[5, 6, 1]])
  encoded, cache, logits = _encode_and_step(config, variables, encoder_tokens)
  assert encoded.dtype == jnp.bfloat16
  assert cache.layers[0].self_keys.dtype == jnp.bfloat16
  assert logits.dtype == jnp.float32  # Logits stay float32, as T5X.
  # The same weights in float32 give nearly the same logits.
  f32_logits = _float32_forward(config, variables, encoder_tokens,
                                jnp.zeros((1, 1), jnp.int32))
  np.testing.assert_allclose(logits, f32_logits, atol=0.1, rtol=0.05)


# ----------------------------------------------------------------------------------
# The wheel: what a non-editable `pip install .` installs, tested as installed.

REPO = pathlib.Path(__file__).resolve().parents[1]


def _declared_packages() -> set[str]:
  with open(REPO / 'pyproject.toml', 'rb') as f:
    return set(tomllib.load(f)['tool']['setuptools']['packages'])


def test_pyproject_lists_every_package_of_the_tree():
  on_disk = {'.'.join(p.parent.relative_to(REPO).parts)
             for p in (REPO / 'jaxspec').rglob('__init__.py')}
  assert _declared_packages() == on_disk | {'jaxspec.gin', 'jaxspec.configs'}


def test_the_wheel_carries_every_file_the_kernel_build_reads_and_the_gin_files(
    installed_wheel):
  _, names = installed_wheel
  for source in cpu_matmul.SOURCES + cpu_matmul.HEADERS:
    assert str(source.relative_to(REPO)) in names, source
  for tree in ('gin', 'configs'):
    for gin_file in (REPO / tree).rglob('*.gin'):
      assert f'jaxspec/{gin_file.relative_to(REPO)}' in names, gin_file


@pytest.mark.skipif(cpu_matmul.kernel_isa() is None or cpu_matmul._compiler() is None,
                    reason='the CPU kernel needs AVX2 + FMA and a C++ compiler')
def test_installed_launcher_runs_from_another_directory_with_the_kernel(
    installed_wheel, tmp_path):
  """jaxspec-infer from the wheel, run outside the checkout: gin files from the
  package, checkpoints and data from --checkpoint_dir / --data_dir, and the kernel
  built afresh from the installed sources (a cache of its own)."""
  python, _ = installed_wheel
  env = dict(venv_environment(python), JAXSPEC_KERNEL_CACHE=str(tmp_path / 'kernels'))
  where = subprocess.run([python, '-c', 'import jaxspec; print(jaxspec.__file__)'],
                         cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
  assert str(python.parents[1]) in where.stdout, where.stdout  # the venv's, not the checkout's
  subprocess.run(
      [python.parent / 'jaxspec-infer', '--gin_file=configs/infer/ende_local.gin',
       '--gin.infer.num_examples=1', "--gin.infer.output_dir='out'",
       f'--checkpoint_dir={REPO / "checkpoints"}', f'--data_dir={REPO / "data"}'],
      cwd=tmp_path, env=env, check=True, capture_output=True)
  summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
  assert summary['matmul'].startswith('kernel ('), summary['matmul']
  assert summary['identical_outputs'] == summary['examples'] == 1
  assert list((tmp_path / 'kernels').iterdir())  # built from the wheel's sources


def test_the_installed_command_away_from_a_checkout_ends_user_errors_with_one_line(
    installed_wheel, tmp_path):
  """jaxspec-infer from the wheel in a directory that is no checkout: the shipped data it
  cannot find, and a bad setting, each one line naming the fix, exit status 2."""
  python, _ = installed_wheel
  env = {k: v for k, v in venv_environment(python).items()
         if k not in ('JAXSPEC_DATA_DIR', 'JAXSPEC_CHECKPOINT_DIR')}
  for flags, expected in (
      ([], r'^jaxspec-infer: error: the shipped data not found: looked for \S+/data/vocab/'
           r"spm.model \(the working directory\); .* point --data_dir or \$JAXSPEC_DATA_DIR "
           r"at a checkout's data/\.$"),
      (['--gin.GAMMA=-1'], r'^jaxspec-infer: error: gamma must be >= 1, got -1$')):
    result = subprocess.run([python.parent / 'jaxspec-infer', *flags], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert 'Traceback' not in result.stderr, result.stderr
    assert re.search(expected, result.stderr.strip().splitlines()[-1]), result.stderr


def test_every_console_entry_point_and_script_wrapper_reaches_a_launcher():
  with open(REPO / 'pyproject.toml', 'rb') as f:
    scripts = tomllib.load(f)['project']['scripts']
  for name, target in scripts.items():
    module, _, function = target.partition(':')
    assert module.startswith('jaxspec.launch.'), (name, target)
    assert callable(getattr(importlib.import_module(module), function)), (name, target)
  # scripts/ holds thin wrappers only: each runs one launcher's entry point.
  for wrapper in (REPO / 'scripts').glob('*.py'):
    text = wrapper.read_text()
    assert len(text.splitlines()) <= 12, wrapper
    launcher = re.search(r'from (jaxspec\.launch\.\w+) import', text)
    assert launcher and importlib.util.find_spec(launcher.group(1)), wrapper
