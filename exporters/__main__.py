"""``python -m exporters --config JSON``: the exporter process obs starts (see :mod:`exporters.sidecar`)."""

import sys

from exporters.sidecar import main

sys.exit(main())
