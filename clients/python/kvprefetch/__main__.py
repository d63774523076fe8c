"""`python -m kvprefetch`, for hosts where the console script is not on PATH."""

import sys

from kvprefetch.cli import main

sys.exit(main())
