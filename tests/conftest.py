"""Shared fixtures. etcd fixtures start real etcd servers on free loopback ports."""
