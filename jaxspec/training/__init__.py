"""Training: T5 pairs (core), draft distillation (distillation) and encoder-sharing
drafts (shared_encoder)."""
