"""``python -m kvcache``: the command line (see kvcache.cli)."""
import sys

from kvcache.cli import main

sys.exit(main())
