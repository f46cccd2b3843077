"""``python -m yax``: the same command as ``yax``."""

import sys

from yax._cli import main

if __name__ == '__main__':
  sys.exit(main())
