import sys

from retina_server.node_server import main

sys.exit(main())
