"""The HTTP data plane: parse once, schedule, forward bytes, stream back."""
