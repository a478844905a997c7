"""`jaxspec-train`: see jaxspec/launch/train.py, or run with --help."""

from jaxspec.launch.train import main

if __name__ == '__main__':
  main()
