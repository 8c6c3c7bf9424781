"""Development and test tooling, not part of the Retina runtime.

``cluster`` starts a private local cluster (etcd, PostgreSQL, TransServer and
optionally Retina nodes) for the tests, the benchmarks, the fault campaign and
``make demo``; ``cluster_cli`` is ``retina-cluster``; ``standin`` is the demo's
stand-in lifecycle writer. No runtime package imports from here.
"""
