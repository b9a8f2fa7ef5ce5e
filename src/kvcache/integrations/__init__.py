"""Integrations of kvcache with other libraries; each module imports its library only when it is
imported itself (``kvcache.integrations.transformers`` needs torch and transformers)."""
