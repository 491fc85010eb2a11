"""``python -m sglang_disagg_ext ...``: the same command line as ``sglang-disagg-ext``."""

import sys

from sglang_disagg_ext.cli import main

sys.exit(main())
