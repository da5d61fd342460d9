"""``python -m msc.cli ARGS``: the ``msc`` command."""
import sys

from msc.cli.main import main

sys.exit(main())
