"""``python -m gpuop``: the same as the ``gpuop`` command."""

import sys

from gpuop.cli.commands import main

sys.exit(main())
