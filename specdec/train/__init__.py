"""`specdec distill`: training drafts for a target (a small draft model, or a feature-level head)."""
