"""README's code runs as written.

Its Python code blocks run in order in one interpreter (as a reader runs them, a later
block using the names an earlier one defined), from the repository root as after
`pip install -e .`. Its shell blocks (Install, Quickstart) run as a newcomer runs them:
in order, from a checkout, in a fresh virtual environment holding the wheel of the
checkout (what `pip install .` installs), each `jaxspec-infer` cut to three examples by
the flag README names for that. A block that needs what this machine lacks (a device
mesh, gs:// checkpoints), or that is an alternative to another, is marked by the HTML
comment `<!-- readme-test: skip (reason) -->` on the line before it."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from _wheel import venv_environment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# README's flag that cuts a jaxspec-infer run to its first examples.
QUICK_LOOK = '--gin.infer.num_examples=3'


def _readme() -> str:
  with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
    return f.read()


def _blocks(language: str) -> list[tuple[str | None, str]]:
  """(skip reason or None, code) of every ```<language> block, in order."""
  block = re.compile(r'(<!-- readme-test: skip \(([^)]*)\) -->\n)?```' + language
                     + r'\n(.*?)```', re.S)
  return [(match.group(2) if match.group(1) else None, match.group(3))
          for match in block.finditer(_readme())]


def test_readme_python_blocks_run_as_written():
  blocks = _blocks('python')
  assert all(reason.strip() for reason, _ in blocks if reason is not None), blocks
  runnable = [code for reason, code in blocks if reason is None]
  assert runnable, 'the README has no runnable python block'
  # Each block runs as its own compiled unit, so a failure names its block.
  program = '\n'.join(f'print("--- README block {i}", flush=True)\n'
                      f'exec(compile({code!r}, "README block {i}", "exec"))'
                      for i, code in enumerate(runnable))
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  result = subprocess.run([sys.executable, '-c', program], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def _shell_commands() -> list[str]:
  """The commands of README's runnable ```bash blocks, in order: a line each (with its
  backslash continuations), comment lines left out."""
  blocks = _blocks('bash')
  assert all(reason.strip() for reason, _ in blocks if reason is not None), blocks
  commands = []
  for reason, code in blocks:
    if reason is None:
      for command in code.replace('\\\n', ' ').splitlines():
        if command.strip() and not command.lstrip().startswith('#'):
          commands.append(command.strip())
  return commands


def _without_comment(command: str) -> str:
  return re.sub(r'\s+#.*$', '', command)


def test_the_readme_names_the_flag_that_cuts_the_quickstart():
  assert f'`{QUICK_LOOK}` after `jaxspec-infer`' in _readme()
  commands = _shell_commands()
  assert _without_comment(commands[0]) == 'pip install .', commands  # The wheel stands for it.
  assert any(command.split()[0] == 'jaxspec-infer' for command in commands[1:]), commands


def test_ci_runs_exactly_the_readmes_test_command():
  [(reason, code)] = [block for block in _blocks('bash') if 'pytest' in block[1]]
  assert reason, 'the test command runs the suite itself: it is marked skip'
  with open(os.path.join(REPO, '.ci', 'run'), encoding='utf-8') as f:
    assert code.strip() in f.read().splitlines()


def test_readme_shell_commands_run_as_written_in_order_in_a_fresh_venv(installed_wheel,
                                                                         tmp_path):
  """Install's `pip install .` is the wheel installed_wheel installed; every later command
  runs in a checkout (the working directory holding the checkout's data/ and
  checkpoints/, found there), with the venv's commands first on PATH."""
  python, _ = installed_wheel
  checkout = tmp_path / 'checkout'
  checkout.mkdir()
  for name in ('data', 'checkpoints'):
    (checkout / name).symlink_to(os.path.join(REPO, name), target_is_directory=True)
  # A calibration of gamma='auto' from three examples stays with the test.
  env = dict(venv_environment(python), JAXSPEC_CALIBRATION_DIR=str(tmp_path / 'calibrations'))
  runs = []
  for command in _shell_commands()[1:]:
    cut = re.sub(r'(^|\|\s*)jaxspec-infer\b', rf'\g<0> {QUICK_LOOK}', command)
    result = subprocess.run(['bash', '-c', cut], cwd=checkout, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, f'{cut}\n{result.stdout[-2000:]}{result.stderr[-4000:]}'
    assert 'Traceback' not in result.stderr and 'ERROR' not in result.stderr, result.stderr
    runs.append((cut, result))
  # Each jaxspec-infer command wrote a directory of its own: none collided.
  summaries = sorted((checkout / 'results').rglob('summary.json'))
  assert len(summaries) == sum('jaxspec-infer' in cut for cut, _ in runs), summaries
  for path in summaries:
    summary = json.loads(path.read_text())
    assert summary['examples'] in (1, 3), (path, summary)
    if summary['examples'] == 3:  # A split: both decoders, the same outputs.
      assert summary['identical_outputs'] == 3, (path, summary)
      assert summary['baseline_bleu'] == summary['speculative_bleu'], (path, summary)
      assert summary['tokens_per_target_call'] > 1.0, (path, summary)
  own_text = [result for cut, result in runs if '--input_file=-' in cut]
  for result in own_text:  # One JSON line per input on stdout.
    [line] = result.stdout.splitlines()
    assert json.loads(line)['prediction'], line
