"""``python -m pagedserve``: the ``pagedserve`` command."""
import sys

from pagedserve.cluster.entrypoints.cli import main

sys.exit(main())
