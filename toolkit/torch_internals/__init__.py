"""The door to torch's native and private parts: what binds a native library (cuBLASLt) or
reaches below torch's public API lives here, beside the torch fence in `versions`."""
