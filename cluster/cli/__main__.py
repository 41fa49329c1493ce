"""``python -m dspine.cluster.cli ...`` runs the ``dspine`` command line."""

import sys

from . import main

sys.exit(main())
