"""``python -m cdc_client``: the same as ``retina-cdc``."""

import sys

from cdc_client.main import main

sys.exit(main())
