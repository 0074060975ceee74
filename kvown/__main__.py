"""``python -m kvown``: the same command line as the ``kvown`` console script."""

from kvown.cli import main

raise SystemExit(main())
