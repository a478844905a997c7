"""`jaxspec-soak`: see jaxspec/launch/soak.py, or run with --help."""

import sys

from jaxspec.launch.soak import cli

if __name__ == '__main__':
  sys.exit(cli())
