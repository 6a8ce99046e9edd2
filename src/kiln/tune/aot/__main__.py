"""`python -m kiln.tune.aot`: the same sweep as `kiln tune aot` (kiln.tune.aot.sweep)."""

import sys

from kiln.tune.aot.sweep import main

if __name__ == "__main__":
    sys.exit(main())
