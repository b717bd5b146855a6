"""Hand-written parallel model implementations, one folder per architecture (shared blocks in ``common``)."""
