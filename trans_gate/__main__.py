import sys

from trans_gate.trans_server import main

sys.exit(main())
