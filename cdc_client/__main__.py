"""``python -m cdc_client``: the same as ``retina-cdc``."""

import sys

from cdc_client.connector_main import main

sys.exit(main())
