"""`python -m irminsul`: the same command line as `irminsul`."""

import sys

from irminsul.cli import main

sys.exit(main())
