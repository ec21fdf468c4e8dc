"""What the tests share, one concept a module. Import what you use: ``from tests.support.ranks import run_ranks``.

ranks      launching gloo ranks on CPU: ``run_ranks`` (ranks meant to finish) and ``Zygote`` (ranks meant to be killed)
models     the toy FSDP2 / HSDP / FSDP+TP models, training, and save/load as a checkpointing user would
compare    ``assert_state_equal``: bit-exact comparison of nested states, naming the first difference
states     bit patterns of every dtype, blank load targets, save and load without a process group
faults     kill hooks, the crash trials' state and rank programs, ``causes`` of a failed save or load
shardings  the rank program of the random-sharding property test
stores     a store's files on disk: tree digests, chunk files, the root manifest read and edited in place
s3         the loopback S3 server (radosgw behind a counting, fault-injecting proxy; moto outside CI without Ceph)

Rank functions passed to ``run_ranks`` or ``Zygote.launch`` must be module-level (they travel pickled by reference).
The fixtures built on these (the S3 server, the zygote, store copies) are in tests/conftest.py.
"""
