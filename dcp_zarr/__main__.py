"""``python -m dcp_zarr``: the same as the ``dcp-zarr`` command."""

import sys

from dcp_zarr.cli import main

sys.exit(main())
