"""``python -m bench.runs.overload``: see the package's docstring."""

import sys

from bench.runs.overload import main

sys.exit(main())
