"""`python -m mol2_cli ...` is `mol2 ...`."""
import sys

from . import main

sys.exit(main())
