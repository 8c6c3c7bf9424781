import sys

from retina_server.server import main

sys.exit(main())
