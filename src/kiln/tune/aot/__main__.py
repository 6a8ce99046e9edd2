"""`python -m kiln.tune.aot`: the same sweep as `kiln tune aot` (kiln.tune.aot.sweep)."""

import sys

from kiln.tune.aot.sweep import main

sys.exit(main())
