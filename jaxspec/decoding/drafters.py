"""Every drafter, and the interface they implement, in one place to import from."""

from jaxspec.decoding.drafter import DraftContext, Drafter, draw_tokens
from jaxspec.decoding.ngram import BigramDrafter, UnigramDrafter, fit_bigram, fit_unigram
from jaxspec.decoding.prompt_lookup import PromptLookupDrafter
from jaxspec.decoding.t5_drafter import T5Drafter

__all__ = ['BigramDrafter', 'DraftContext', 'Drafter', 'PromptLookupDrafter', 'T5Drafter',
           'UnigramDrafter', 'draw_tokens', 'fit_bigram', 'fit_unigram']
