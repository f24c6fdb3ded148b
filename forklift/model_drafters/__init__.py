"""Drafters that run a model (a draft model, the checkpoint's MTP layer) for speculative
decoding; they sit above the runner, whose model runner they drive (spec_decode/ holds the
lookup proposers and the protocol all drafters share)."""
