import sys

from trans_gate.server import main

sys.exit(main())
