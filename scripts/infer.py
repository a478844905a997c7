"""`jaxspec-infer`: see jaxspec/launch/infer.py, or run with --help."""

from jaxspec.launch.infer import main

if __name__ == '__main__':
  main()
