"""Speculative decoding: drafts proposed cheaply, verified by the target in one forward.

A decode row that speculates feeds its last token plus d drafted tokens in one forward of the
target and samples at all 1 + d positions (verify.py says which drafts are kept and why the
output distribution is the target's). Drafts: `ngram.py` copies continuations from the
request's own prompt and output; `self_draft.py` runs the policy's own first layers, final norm
and head, so a weight update updates the draft with it. `lengths.py` picks the draft length of
each step from measured tokens per second; `speculator.py` is what the scheduler holds.
"""
