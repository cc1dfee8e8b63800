import sys

from odma_hw.cli import main

sys.exit(main())
