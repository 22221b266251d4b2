"""Token sources: the synthetic task and tokenized, packed text and chat records."""
