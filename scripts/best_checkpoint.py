"""`jaxspec-best-checkpoint`: see jaxspec/launch/best_checkpoint.py, or run with --help."""

from jaxspec.launch.best_checkpoint import main

if __name__ == '__main__':
  main()
