"""`jaxspec-step-costs`: see jaxspec/launch/step_costs.py, or run with --help."""

import sys

from jaxspec.launch.step_costs import cli

if __name__ == '__main__':
  sys.exit(cli())
