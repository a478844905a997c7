"""`jaxspec-export-checkpoint`: see jaxspec/launch/export_checkpoint.py, or run with --help."""

from jaxspec.launch.export_checkpoint import main

if __name__ == '__main__':
  main()
