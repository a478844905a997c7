"""jaxspec.launch.platform_settings: what the launchers set on each platform.

- The draft loop form per platform (the early exit on the CPU, static elsewhere) and the
  XLA flags of the table; the platform JAX will start on, read from JAX_PLATFORMS or
  the installed plugins without starting it.
- apply() adds the platform's flags to XLA_FLAGS, never over a flag the user set, and
  nothing once JAX has started; in a fresh process the flags it adds reach the backend
  (XLA would abort on one it refused) and record() reports them with the platform and
  the draft loop form. jaxspec-infer's summary carries the record
  (tests/test_scripts.py); jaxspec-infer and jaxspec-batch-sizes apply before parsing.
"""

import ast
import inspect
import textwrap
import json
import os
import subprocess
import sys

import pytest

from jaxspec.launch import batch_sizes, infer, platform_settings


def test_each_platform_draft_loop_and_flags(monkeypatch):
  assert platform_settings.settings_for('cpu').draft_loop == 'early_exit'
  for platform in ('gpu', 'cuda', 'rocm', 'tpu'):
    settings = platform_settings.settings_for(platform)
    assert settings.draft_loop == 'static' and settings.platform in ('gpu', 'tpu')
  monkeypatch.setitem(platform_settings.PLATFORM_XLA_FLAGS, 'gpu', ('--xla_a=1',))
  assert platform_settings.settings_for('cuda').xla_flags == ('--xla_a=1',)
  assert platform_settings.settings_for('cpu').xla_flags == ()


def test_the_expected_platform_is_read_without_starting_jax(monkeypatch):
  expected = platform_settings.expected_platform
  assert expected({'JAX_PLATFORMS': 'cuda,cpu'}) == 'gpu'
  assert expected({'JAX_PLATFORMS': 'tpu'}) == 'tpu'
  assert expected({'JAX_PLATFORMS': 'cpu'}) == 'cpu'
  assert expected({'JAX_PLATFORM_NAME': 'gpu'}) == 'gpu'
  installed = set()
  monkeypatch.setattr(platform_settings, '_installed', lambda module: module in installed)
  assert expected({}) == 'cpu'
  installed.add('jax_cuda12_plugin')
  assert expected({}) == 'gpu'
  installed.add('libtpu')
  assert expected({}) == 'tpu'


def test_flags_are_added_where_the_user_set_none():
  flags, added = platform_settings.with_flags(
      '--xla_b=user --xla_c=1', ('--xla_a=1', '--xla_b=ours'))
  assert added == ['--xla_a=1'] and flags == '--xla_b=user --xla_c=1 --xla_a=1'
  assert platform_settings.with_flags('', ()) == ('', [])


def test_apply_adds_the_expected_platforms_flags_before_jax_starts(monkeypatch):
  monkeypatch.setitem(platform_settings.PLATFORM_XLA_FLAGS, 'gpu',
                      ('--xla_gpu_graph_min_graph_size=1', '--xla_b=ours'))
  monkeypatch.setattr(platform_settings, 'backend_started', lambda: False)
  environ = {'JAX_PLATFORMS': 'cuda', 'XLA_FLAGS': '--xla_b=user'}
  assert platform_settings.apply(environ) == ['--xla_gpu_graph_min_graph_size=1']
  assert environ['XLA_FLAGS'] == '--xla_b=user --xla_gpu_graph_min_graph_size=1'
  cpu = {'JAX_PLATFORMS': 'cpu'}
  assert platform_settings.apply(cpu) == [] and 'XLA_FLAGS' not in cpu
  # Once JAX has started (as in this process) the flags would not be read: none added.
  monkeypatch.setattr(platform_settings, 'backend_started', lambda: True)
  late = {'JAX_PLATFORMS': 'cuda'}
  assert platform_settings.apply(late) == [] and 'XLA_FLAGS' not in late


def test_a_fresh_process_starts_jax_with_the_flags_and_records_them():
  flag = '--xla_gpu_graph_min_graph_size=2'  # a GPU flag: XLA:CPU takes it, inert
  program = (
      'import json\n'
      'from jaxspec.launch import platform_settings as p\n'
      f"p.PLATFORM_XLA_FLAGS['cpu'] = ({flag!r},)\n"
      'added = p.apply()\n'
      'import jax\n'
      'jax.devices()\n'
      "print(json.dumps({'added': added, 'record': p.record()}))\n")
  environ = dict(os.environ, JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-c', program], env=environ, capture_output=True,
                       text=True, check=True)
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result['added'] == [flag]
  record = result['record']
  assert record['platform'] == 'cpu' and record['draft_loop'] == 'early_exit'
  assert record['xla_flags'].endswith(flag) and record['platform_xla_flags'] == [flag]


@pytest.mark.parametrize('launcher', [infer, batch_sizes])
def test_the_decoding_launchers_apply_before_anything_else(launcher):
  function = ast.parse(textwrap.dedent(inspect.getsource(launcher.main))).body[0]
  statements = function.body[1:] if ast.get_docstring(function) else function.body
  first = ast.unparse(statements[0])
  assert first.startswith('platform_settings.apply()'), first


def test_the_record_names_the_form_a_setting_runs_here():
  assert platform_settings.record()['draft_loop'] == 'early_exit'  # the CPU's 'auto'
  assert platform_settings.record('static')['draft_loop'] == 'static'
