"""`jaxspec-train-feature-draft`: see jaxspec/launch/train_feature_draft.py, or run with --help."""

from jaxspec.launch.train_feature_draft import main

if __name__ == '__main__':
  main()
