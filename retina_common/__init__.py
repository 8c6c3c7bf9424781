"""Code shared by every Retina process: configuration, topology, catalog, etcd,
failpoints, logging, metrics, gRPC plumbing and the generated protobuf modules."""
