"""``python -m knapformer`` = the ``knapformer`` CLI."""

import sys

from knapformer.cli import main

sys.exit(main())
