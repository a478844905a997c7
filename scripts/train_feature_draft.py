"""`jaxspec-train-feature-draft`: see jaxspec/launch/train_feature_draft.py, or run with --help."""

import sys

from jaxspec.launch.train_feature_draft import cli

if __name__ == '__main__':
  sys.exit(cli())
