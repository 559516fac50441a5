"""The CPU decoding kernels, their cache, the whole decoding step and quantize()."""
