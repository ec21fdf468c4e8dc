"""``python -m dcp_zarr``: the same as the ``dcp-zarr`` command."""

import sys

from dcp_zarr.tools.cli import main

sys.exit(main())
