"""`python -m bastion` is the `bastion` command."""

import sys

from bastion.cli import main

sys.exit(main())
