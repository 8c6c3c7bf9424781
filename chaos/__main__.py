import sys

from chaos.campaign import main

sys.exit(main())
