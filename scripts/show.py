"""`jaxspec-show`: see jaxspec/launch/show.py, or run with --help."""

from jaxspec.launch.show import main

if __name__ == '__main__':
  main()
