"""The control plane: membership, quorum, commands and status of one job."""
