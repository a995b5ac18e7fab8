"""Host bookkeeping, no JAX: requests and their sequences, the KV block pool and the scheduler."""
