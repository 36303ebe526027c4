"""Logits transforms, the plain sampler and the rejection sampler front end."""
