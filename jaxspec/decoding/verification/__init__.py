"""Verification rules: how the target judges a proposal, one module a rule.

  token    Algorithm 1: drafts judged one by one (lenience, adaptive gamma, trees)
  block    the drafts judged jointly (Sun et al. 2025); exact only
  coupled  drafts and target draws share each position's Gumbel noise; exact only,
           output equal to the baseline's for the same key
  tree     k drafts per row verified in one step over a token tree (num_drafts > 1)

Each module's RULE says which SpeculativeConfig options it takes; SpeculativeConfig
derives its compatibility checks from RULES and TREE_RULE.
"""

from jaxspec.decoding.verification import block, coupled, token, tree
from jaxspec.decoding.verification.rule import VerificationRule

RULES = {rule.name: rule for rule in (token.RULE, block.RULE, coupled.RULE)}
TREE_RULE = tree.RULE  # what multi-draft (num_drafts > 1) verification takes

__all__ = ['RULES', 'TREE_RULE', 'VerificationRule', 'block', 'coupled', 'token', 'tree']
