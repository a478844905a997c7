"""`jaxspec-cost-model`: see jaxspec/launch/cost_model.py, or run with --help."""

import sys

from jaxspec.launch.cost_model import cli

if __name__ == '__main__':
  sys.exit(cli())
