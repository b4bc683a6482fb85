"""The door to torch's native and private parts: what binds a native library (cuBLASLt) or
calls below torch's public API (torch.compile's knobs, a oneDNN query) lives here; the
private calls are listed, with where and why, in `versions.torch_version`."""
