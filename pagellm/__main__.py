"""`python -m pagellm ...` is the `pagellm` command."""

import sys

from pagellm.cli import main

sys.exit(main())
