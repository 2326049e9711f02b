"""``python -m course_utils.bench``: the benchmark's command line (see ``course_utils.bench``)."""

import sys

from .cli import main

sys.exit(main())
