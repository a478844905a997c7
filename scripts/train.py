"""`jaxspec-train`: see jaxspec/launch/train.py, or run with --help."""

import sys

from jaxspec.launch.train import cli

if __name__ == '__main__':
  sys.exit(cli())
