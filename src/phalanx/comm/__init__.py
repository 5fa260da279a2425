"""The data plane: reconfigurable process groups and state transfer between replicas."""
