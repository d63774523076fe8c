"""`python -m kvprefetchd` runs the daemon, like the `kvprefetchd` console script."""

import sys

from kvprefetchd.cli import main

sys.exit(main())
