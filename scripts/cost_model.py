"""`jaxspec-cost-model`: see jaxspec/launch/cost_model.py, or run with --help."""

from jaxspec.launch.cost_model import main

if __name__ == '__main__':
  main()
