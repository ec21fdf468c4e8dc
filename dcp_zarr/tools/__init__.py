"""The ``dcp-zarr`` command and what it runs: inspect, verify, diff, convert, list and prune. Leaves: nothing in the
save or load path imports them. The command is the public face; the modules are implementation."""
