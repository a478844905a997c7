"""The README's Python code blocks run as written (from the repository root, as a new
user would after `pip install -e .`). A block that needs what this machine lacks (a
TPU pod, gs:// checkpoints) is marked by an HTML comment `<!-- readme-test: skip
(reason) -->` on the line before it."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BLOCK = re.compile(r'(?:<!-- readme-test: skip \(([^)]+)\) -->\n)?```python\n(.*?)```', re.S)


def _python_blocks():
  with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
    text = f.read()
  return [(match.group(1), match.group(2)) for match in _BLOCK.finditer(text)]


def test_the_readme_has_runnable_blocks():
  blocks = _python_blocks()
  assert sum(reason is None for reason, _ in blocks) >= 1
  assert all(reason.strip() for reason, _ in blocks if reason is not None)


@pytest.mark.parametrize('index', [i for i, (reason, _) in enumerate(_python_blocks())
                                   if reason is None])
def test_readme_python_block_runs_as_written(index, tmp_path):
  code = _python_blocks()[index][1]
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  result = subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, f'README block {index}:\n{code}\n{result.stderr[-3000:]}'
