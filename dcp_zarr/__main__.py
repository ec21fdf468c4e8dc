"""``python -m dcp_zarr``: the same as the ``dcp-zarr`` command.
Implementation of the command's entry."""

import sys

from dcp_zarr.tools.cli import main

sys.exit(main())
