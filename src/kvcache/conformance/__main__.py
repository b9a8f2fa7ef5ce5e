import sys

from kvcache.conformance import main

sys.exit(main())
