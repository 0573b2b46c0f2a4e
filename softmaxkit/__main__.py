"""``python -m softmaxkit``: the same as the ``softmaxkit`` command."""

import sys

from .cli import main

sys.exit(main())
