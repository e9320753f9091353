"""The boundary around the executor: bubblewrap's namespaces and mounts, libseccomp's filter,
and the isolation level that decides what a pool may start without."""
