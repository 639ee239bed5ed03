"""Scale-out: several worker processes on one port, and several replicas, sharing routing state."""
