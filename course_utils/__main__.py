"""``python -m course_utils``: the doctor."""

import sys

from .environment import main

sys.exit(main())
