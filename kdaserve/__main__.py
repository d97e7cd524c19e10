"""`python -m kdaserve ...`: the same commands as the `kdaserve` script."""

import sys

from kdaserve.cli import main

sys.exit(main())
