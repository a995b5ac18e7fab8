"""The device side: the attention seam, the sampler, the persistent input batch and the model runner."""
