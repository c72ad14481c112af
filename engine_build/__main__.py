"""`python -m engine_build ...` is `mol2 build ...` (engine_build/cli.py)."""
import sys

from .cli import main

sys.exit(main())
