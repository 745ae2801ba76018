"""Model runner and sampling: runs a ForwardBatch through the model and draws tokens."""
