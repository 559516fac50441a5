"""`python -m gpt2attn ...` runs the `gpt2attn` command (for when the console script is not on PATH)."""

import sys

from .cli import main

sys.exit(main())
