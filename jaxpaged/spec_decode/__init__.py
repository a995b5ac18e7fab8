"""Speculative decoding (issue #31): configuration, proposers and the verification sampler."""
