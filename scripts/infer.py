"""`jaxspec-infer`: see jaxspec/launch/infer.py, or run with --help."""

import sys

from jaxspec.launch.infer import cli

if __name__ == '__main__':
  sys.exit(cli())
