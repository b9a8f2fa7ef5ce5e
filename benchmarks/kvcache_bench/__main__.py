"""``python -m kvcache_bench``: ``kvcache bench`` (see kvcache_bench.main)."""
from kvcache_bench import main

raise SystemExit(main())
