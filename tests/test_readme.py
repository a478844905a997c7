"""The README's Python code blocks run as written, in order in one interpreter (as a
reader runs them, a later block using the names an earlier one defined), from the
repository root as after `pip install -e .`. A block that needs what this machine
lacks (a device mesh, gs:// checkpoints) is marked by the HTML comment
`<!-- readme-test: skip (reason) -->` on the line before it."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BLOCK = re.compile(r'(<!-- readme-test: skip \(([^)]*)\) -->\n)?```python\n(.*?)```', re.S)


def _python_blocks() -> list[tuple[str | None, str]]:
  """(skip reason or None, code) of every ```python block, in order."""
  with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
    text = f.read()
  return [(match.group(2) if match.group(1) else None, match.group(3))
          for match in _BLOCK.finditer(text)]


def test_readme_python_blocks_run_as_written():
  blocks = _python_blocks()
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
