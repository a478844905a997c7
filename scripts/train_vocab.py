"""`jaxspec-train-vocab`: see jaxspec/launch/train_vocab.py, or run with --help."""

import sys

from jaxspec.launch.train_vocab import cli

if __name__ == '__main__':
  sys.exit(cli())
