"""``python -m msc ARGS``: the ``msc`` command (where the script is not on PATH)."""
import sys

from msc.cli.main import main

sys.exit(main())
