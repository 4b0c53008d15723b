"""The etcd adapter: the only code in stalwart that talks to etcd."""
