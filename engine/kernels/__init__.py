"""Device kernels that torch does not provide. Each is optional: callers check availability and
fall back to plain torch, and every kernel is tested against that fallback."""
