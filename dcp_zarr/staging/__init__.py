"""Staging for ``dcp.async_save``: the copy training waits for (async_stager.py, the writer as DCP's AsyncStager),
into host buffers the process keeps from one save to the next (pool.py).
Implementation: ``ZarrWriter`` is what users pass to ``dcp.async_save``."""
