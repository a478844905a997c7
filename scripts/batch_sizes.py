"""`jaxspec-batch-sizes`: see jaxspec/launch/batch_sizes.py, or run with --help."""

from jaxspec.launch.batch_sizes import main

if __name__ == '__main__':
  main()
