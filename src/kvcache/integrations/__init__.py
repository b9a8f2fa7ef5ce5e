"""Integrations of kvcache with other libraries; each module imports its library only when used."""
