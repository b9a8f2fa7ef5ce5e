"""Adapters of kvcache to other libraries; each imports its library only when it is imported
itself (``kvcache.integrations.transformers`` needs torch and transformers)."""
