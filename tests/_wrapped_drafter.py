"""A drafter the tests build around another: WrappedDrafter(inner) has inner's vocabulary,
state and proposals; subclasses override what they change (and nothing else: the optional
capabilities keep Drafter's defaults)."""

import dataclasses

from jaxspec.decoding.drafters import Drafter


@dataclasses.dataclass(frozen=True)
class WrappedDrafter(Drafter):
  inner: Drafter

  @property
  def vocab_size(self):
    return self.inner.vocab_size

  def init_state(self, params, encoder_tokens, max_length):
    return self.inner.init_state(params, encoder_tokens, max_length)

  def propose(self, params, state, context, gamma, sampling, keys):
    return self.inner.propose(params, state, context, gamma, sampling, keys)
