"""`jaxspec-best-checkpoint`: see jaxspec/launch/best_checkpoint.py, or run with --help."""

import sys

from jaxspec.launch.best_checkpoint import cli

if __name__ == '__main__':
  sys.exit(cli())
