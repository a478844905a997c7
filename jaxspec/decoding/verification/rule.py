"""What a verification rule supports: the options SpeculativeConfig may combine with it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class VerificationRule:
  """A verification rule's name and the SpeculativeConfig options it takes."""
  name: str
  exact_only: bool  # lenience must be 1 (the rule has no lenient form)
  adaptive_gamma: bool  # takes draft_confidence_threshold > 0 (rows drafting < gamma)
  multi_draft: bool  # takes num_drafts > 1 (a token tree)
  verify_lengths: bool  # takes shorter verify steps

  def unsupported(self, *, lenience: float, draft_confidence_threshold: float,
                  num_drafts: int, verify_lengths: tuple[int, ...]) -> list[str]:
    """The settings given that this rule cannot take, as 'name value' strings."""
    return [setting for setting, refused in (
        (f'lenience {lenience}', self.exact_only and lenience != 1.0),
        (f'draft_confidence_threshold {draft_confidence_threshold}',
         not self.adaptive_gamma and draft_confidence_threshold > 0.0),
        (f'num_drafts {num_drafts}', not self.multi_draft and num_drafts > 1),
        (f'verify_lengths {verify_lengths}', not self.verify_lengths and bool(verify_lengths)),
    ) if refused]

  def describe(self) -> str:
    """The options this rule takes, in words (for error messages)."""
    return ', '.join((
        'exact only (lenience 1)' if self.exact_only else 'lenience in (0, 1]',
        'adaptive gamma' if self.adaptive_gamma else 'a fixed gamma',
        'multi-draft trees' if self.multi_draft else 'one draft a row',
        'shorter verify steps' if self.verify_lengths else 'no shorter verify steps'))
