"""`jaxspec-step-costs`: see jaxspec/launch/step_costs.py, or run with --help."""

from jaxspec.launch.step_costs import main

if __name__ == '__main__':
  main()
