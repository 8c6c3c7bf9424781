import sys

from chaos.main import main

sys.exit(main())
