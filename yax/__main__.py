"""``python -m yax``: the same command as ``yax``."""

import sys

from yax._src.cli.main import main

if __name__ == '__main__':
  sys.exit(main())
