"""`jaxspec-export-checkpoint`: see jaxspec/launch/export_checkpoint.py, or run with --help."""

import sys

from jaxspec.launch.export_checkpoint import cli

if __name__ == '__main__':
  sys.exit(cli())
