"""Loading policies, reference models and tokenizers from local paths or hub ids, and building tiny test models."""
