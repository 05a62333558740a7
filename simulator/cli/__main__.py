"""``python -m simulator.cli``: the ``clustersim`` command."""

import sys

from simulator.cli.main import main

sys.exit(main())
