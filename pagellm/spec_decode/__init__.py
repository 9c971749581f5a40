"""Speculative decoding: proposers of draft tokens, run in the model runner after sampling.

A proposer guesses the next few tokens of each decoding request (n-gram prompt lookup, a
suffix tree over this and recent requests, a small draft model, EAGLE-3 / MTP heads); the
scheduler gives such a request 1 + k tokens of its next step, the runner verifies them in one
forward pass and the rejection sampler keeps the accepted prefix plus one token
(`pagellm/sample/rejection_sampler.py`).
"""
