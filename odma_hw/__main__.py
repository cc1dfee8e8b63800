import sys

from odma_cli.main import main

sys.exit(main())
